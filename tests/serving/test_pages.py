"""The paged KV-cache books (sharktank.serving.pages): accounting, prefix reuse through the hash
chain, LRU eviction, duplicate commits, and a random model check that no sequence ever reads
positions another sequence wrote with different tokens."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sharktank.serving.pages import PagePool


def _accounted(pool: PagePool) -> bool:
    return pool.free + pool.used + pool.cached_unreferenced == pool.num_pages


def _prefill(pool: PagePool, prompt: list[int]):
    """Open ``prompt``, give it room for one output token, and commit the whole prompt."""
    alloc = pool.open(prompt)
    assert pool.extend(alloc, len(prompt) + 1)
    pool.commit(alloc, prompt, len(prompt))
    return alloc


def test_rejects_empty_pool_and_pages():
    with pytest.raises(ValueError, match="num_pages .* 0"):
        PagePool(0, 16)
    with pytest.raises(ValueError, match="page_size .* -2"):
        PagePool(4, -2)


def test_open_extend_close_accounting():
    pool = PagePool(8, 16)
    assert (pool.free, pool.used, pool.available, pool.pages_for(33)) == (8, 0, 8, 3)
    a = pool.open(list(range(40)))
    assert (a.pages, a.cached_tokens, a.committed) == ([], 0, 0)
    assert pool.extend(a, 41) and len(a.pages) == 3 and len(set(a.pages)) == 3
    assert pool.extend(a, 48) and len(a.pages) == 3  # still within the third page
    assert (pool.used, pool.free) == (3, 5) and _accounted(pool)
    pool.commit(a, list(range(40)), 40)
    assert a.committed == 2 and pool.stats()["cached"] == 2
    pool.close(a)
    assert (pool.used, pool.free, pool.cached_unreferenced) == (0, 6, 2) and _accounted(pool)
    with pytest.raises(ValueError, match="already closed"):
        pool.close(a)
    pool.check()


@pytest.mark.parametrize("diverge, cached", [(32, 32), (20, 16)])
def test_prefix_reuse_needs_whole_equal_pages(diverge, cached):
    pool = PagePool(8, 16)
    prompt_a = list(range(40))
    a = _prefill(pool, prompt_a)
    assert a.committed == 2
    pool.close(a)
    prompt_b = prompt_a[:35]
    prompt_b[diverge] = 999
    b = pool.open(prompt_b)
    assert b.cached_tokens == cached and b.committed == cached // 16
    assert b.pages == a.pages[: cached // 16]
    assert pool.stats()["hits"] == cached and pool.stats()["lookups"] == 2


def test_last_prompt_token_is_always_prefilled():
    pool = PagePool(8, 16)
    prompt = list(range(32))
    pool.close(_prefill(pool, prompt))
    assert pool.stats()["cached"] == 2
    b = pool.open(prompt)
    assert (b.cached_tokens, len(b.pages)) == (16, 1)
    assert pool.open(prompt[:16]).cached_tokens == 0


def test_key_chains_through_all_previous_tokens():
    pool = PagePool(8, 4)
    pool.close(_prefill(pool, [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    # The same second page after a different first page is a different prefix.
    assert pool.open([3, 3, 3, 3, 2, 2, 2, 2, 0]).cached_tokens == 0
    assert pool.open([1, 1, 1, 1, 2, 2, 2, 2, 0]).cached_tokens == 8


def test_eviction_is_lru_and_spares_referenced_pages():
    pool = PagePool(3, 4)
    first, second = [1] * 4 + [9], [2] * 4 + [9]
    pool.close(_prefill(pool, first))
    pool.close(_prefill(pool, second))
    assert (pool.free, pool.cached_unreferenced) == (1, 2)
    held = pool.open(second)  # holds the second prompt's cached page
    assert held.cached_tokens == 4 and pool.cached_unreferenced == 1
    c = pool.open([3] * 8)
    assert pool.extend(c, 8)  # the free page, then the first prompt's page
    assert pool.open(first).cached_tokens == 0
    assert held.pages[0] not in c.pages and pool.available == 0
    before, pages = pool.stats(), list(c.pages)
    assert not pool.extend(c, 9)
    assert pool.stats() == before and c.pages == pages and pool.open(second).cached_tokens == 4
    pool.close(c)
    pool.check()


def test_eviction_shortens_a_prefix_from_its_tail():
    pool = PagePool(3, 4)
    prompt = [1] * 8 + [2]
    pool.close(_prefill(pool, prompt))
    assert (pool.free, pool.cached_unreferenced) == (1, 2)
    c = pool.open([3])
    assert pool.extend(c, 8)  # the free page and one cached page: the prefix's second
    assert pool.open(prompt).cached_tokens == 4


def test_duplicate_commit_stays_private_and_is_freed():
    pool = PagePool(8, 4)
    prompt = [5] * 8 + [6]
    a, b = pool.open(prompt), pool.open(prompt)  # both miss: neither has committed yet
    assert pool.extend(a, 10) and pool.extend(b, 10)
    pool.commit(a, prompt, 9)
    pool.commit(b, prompt, 9)
    assert (a.committed, b.committed) == (2, 0)
    pool.commit(b, prompt + [7, 7, 7], 12)  # stopped for good: its later pages stay private too
    assert b.committed == 0 and pool.stats()["cached"] == 2
    pool.close(b)
    assert (pool.free, pool.cached_unreferenced) == (5, 0)
    pool.close(a)
    assert (pool.free, pool.cached_unreferenced) == (6, 2)
    assert pool.open(prompt).pages == a.pages[:2]


def test_commit_refuses_positions_it_has_no_page_for():
    pool = PagePool(4, 4)
    a = pool.open([1] * 6)
    assert pool.extend(a, 6)
    with pytest.raises(ValueError, match="written 9"):
        pool.commit(a, [1] * 9, 9)


PAGE, PAGES, MAX_OPEN = 4, 6, 4
_tokens = st.lists(st.integers(0, 1), max_size=2 * PAGE)  # a tiny alphabet: pages collide
# Prompts are a cut of one of a few stems (which share their first pages) plus a random tail,
# so that prefixes are often found, shared, committed twice and evicted.
_STEMS = ([0] * 8 + [1] * 8, [0] * 4 + [1] * 12, [0] * 8 + [1] * 4 + [0] * 4)
_prompts = st.builds(
    lambda stem, cut, tail: stem[:cut] + tail,
    st.sampled_from(_STEMS), st.integers(0, 16), _tokens
)


class PoolMachine(RuleBasedStateMachine):
    """Sequences open, grow, write and close at random; a shadow of every page's slots records
    which token was written there, and every sequence must see its own tokens in its pages."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(PAGES, PAGE)
        self.open_seqs: list[list] = []  # [alloc, tokens, written]
        self.slots: dict[int, list] = {}  # page -> token written in each slot

    @precondition(lambda self: len(self.open_seqs) < MAX_OPEN)
    @rule(prompt=_prompts)
    def open(self, prompt):
        alloc = self.pool.open(prompt)
        assert alloc.cached_tokens <= max(0, len(prompt) - 1)
        self.open_seqs.append([alloc, list(prompt), alloc.cached_tokens])

    @precondition(lambda self: len(self.open_seqs) < MAX_OPEN)
    @rule(prompt=_prompts)
    def prefill(self, prompt):
        """What a scheduler does in one step: open, make room for the prompt and one more
        token, write the prompt past its cached prefix, commit."""
        self.open(prompt)
        seq = self.open_seqs[-1]
        if self.pool.extend(seq[0], len(prompt) + 1):
            self._write(seq, len(prompt))

    @precondition(lambda self: self.open_seqs)
    @rule(i=st.integers(0, 99), more=st.integers(0, 2 * PAGE))
    def extend(self, i, more):
        alloc, tokens, written = self.open_seqs[i % len(self.open_seqs)]
        before, pages = self.pool.stats(), list(alloc.pages)
        if not self.pool.extend(alloc, written + more):
            assert self.pool.stats() == before and alloc.pages == pages

    @precondition(lambda self: self.open_seqs)
    @rule(i=st.integers(0, 99), n=st.integers(0, 2 * PAGE), new=_tokens)
    def write_and_commit(self, i, n, new):
        """Write up to ``n`` more positions (decoded tokens ``new`` past the prompt), commit."""
        seq = self.open_seqs[i % len(self.open_seqs)]
        alloc, tokens, written = seq
        end = min(written + n, len(alloc.pages) * PAGE)
        tokens.extend(new[: max(0, end - len(tokens))])
        self._write(seq, min(end, len(tokens)))

    def _write(self, seq: list, end: int) -> None:
        alloc, tokens, written = seq
        for p in range(written, end):
            page = alloc.pages[p // PAGE]
            assert p // PAGE >= alloc.committed and self.pool.ref_count(page) == 1
            self.slots.setdefault(page, [None] * PAGE)[p % PAGE] = tokens[p]
        self.pool.commit(alloc, tokens, end)
        seq[2] = end

    @precondition(lambda self: self.open_seqs)
    @rule(i=st.integers(0, 99))
    def close(self, i):
        alloc, _, _ = self.open_seqs.pop(i % len(self.open_seqs))
        self.pool.close(alloc)

    @invariant()
    def books_agree(self):
        pool = self.pool
        pool.check()
        assert _accounted(pool)
        holders: dict[int, list] = {}
        for alloc, _, _ in self.open_seqs:
            assert len(set(alloc.pages)) == len(alloc.pages)
            for index, page in enumerate(alloc.pages):
                holders.setdefault(page, []).append((alloc, index))
        for page in range(PAGES):
            assert pool.ref_count(page) == len(holders.get(page, []))
        for page, held in holders.items():
            if len(held) > 1:  # shared: only within every holder's committed prefix
                assert all(index < alloc.committed for alloc, index in held)
        assert pool.used == len(holders)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for alloc, tokens, written in self.open_seqs:
            for p in range(written):
                page = alloc.pages[p // PAGE]
                assert self.slots[page][p % PAGE] == tokens[p], (p, alloc)

    def teardown(self):
        for alloc, _, _ in self.open_seqs:
            self.pool.close(alloc)
        assert self.pool.used == 0 and _accounted(self.pool)
        self.pool.check()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
