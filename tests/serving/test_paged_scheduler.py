"""The paged scheduler's policy (pages as a sequence grows, preemption, admission) with a test
playing the model: a fake page pool (the token each device page holds in each slot), read and
written through the plan's page tables, and a fake next-token rule computed from what a call
reads there, so a request whose cache was corrupted, shared wrongly or resumed at the wrong
place generates other tokens than the same request run alone. No model, no threads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sharktank.serving.events import FinishReason
from sharktank.serving.pages import PagePool
from sharktank.serving.paged_scheduler import SCRATCH_PAGE, PagedScheduler
from sharktank.serving.plan import StepPlan, StepResults
from sharktank.serving.request import Request
from sharktank.text.sampling import SamplingParams

PS = 4  # positions a page
T = 64  # the exported cache length


def req(id: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(id, list(prompt), SamplingParams(max_tokens=max_tokens), on_event=lambda e: None)


def next_token(seen: list[int]) -> int:
    """The fake model: a token that depends on every entry read, in order."""
    return 1 + sum((i + 1) * t for i, t in enumerate(seen)) % 7


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


class FakeModel:
    """Runs plans on a fake pool of ``pages + 1`` device pages (0: the scratch page), checking
    that no call writes a page another running request holds or the prefix cache has."""

    def __init__(self, s: PagedScheduler):
        self.s = s
        self.pages = [[None] * PS for _ in range(s.pool.num_pages + 1)]
        self.tokens: dict[int, list[int]] = {}  # request id -> tokens delivered
        self.finish: dict[int, FinishReason] = {}

    def read(self, table, n: int) -> list:
        return [self.pages[table[p // PS]][p % PS] for p in range(n)]

    def write(self, table, pos: int, token: int, owner: Request | None) -> None:
        page = table[pos // PS]
        if page != SCRATCH_PAGE:
            pool_page = page - 1
            assert pool_page not in self.s.pool._key_of, f"write into cached page {pool_page}"
            # Held by the writing row alone, or by nobody: a request that ended with its first
            # token (its prefill's result, applied before the decode runs) leaves its slot's
            # dummy to write into a page just freed, past the full pages it registered.
            holders = [r for r, run in enumerate(self.s._rows) if run is not None and page in self.s.table(r)]
            assert len(holders) <= 1 and (owner is None or holders), f"device page {page} written while held by slots {holders}"
            assert not holders or self.s.table(holders[0]) == tuple(table)
            assert owner is None or self.s._rows[holders[0]].request is owner
        self.pages[page][pos % PS] = token

    def step(self) -> StepPlan:
        s = self.s
        plan = s.schedule()
        self.deliver(plan.finished)
        got = {}
        for call in plan.prefills:
            (p,) = call.rows
            seq = p.sequence
            assert self.read(p.pages, p.start) == seq[: p.start]  # what the chunk attends to before its own
            for pos in range(p.start, p.end):
                self.write(p.pages, pos, seq[pos], p.request)
            if p.last:
                got[p.request.id] = next_token(self.read(p.pages, p.end))
        if got:
            self.deliver(s.update(StepResults(tokens=got)))
        if plan.decode is not None:
            d, got = plan.decode, {}
            live = {i: q for q, i in d.requests}
            for i, (tok, pos, table) in enumerate(zip(d.tokens, d.positions, d.tables)):
                if i in live:
                    q = live[i]
                    fed = q.prompt + self.tokens[q.id]
                    assert pos == len(fed) - 1 and tok == fed[-1]
                    assert self.read(table, pos) == fed[:-1]
                    self.write(table, pos, tok, q)
                    got[q.id] = next_token(self.read(table, pos + 1))
                else:
                    self.write(table, pos, -1, None)  # a dummy, where the row's next real write lands first
            self.deliver(s.update(StepResults(tokens=got)))
        return plan

    def deliver(self, events) -> None:
        for q, e in events:
            assert q.id not in self.finish, f"an event for request {q.id} after its last"
            if e.token is not None:
                self.tokens.setdefault(q.id, []).append(e.token)
            if e.finish_reason is not None:
                self.finish[q.id] = e.finish_reason


def scheduler(pages: int, batch: int = 2, chunk: int = 16) -> PagedScheduler:
    return PagedScheduler(batch, max_queue=64, chunk_tokens=chunk, pool=PagePool(pages, PS), max_seq_len=T)


def test_pages_grow_with_the_sequence():
    s = scheduler(pages=16)
    m = FakeModel(s)
    s.add(req(0, [1, 2, 3, 4, 5], max_tokens=12))
    m.step()  # admitted with its prompt and first decode write: 6 positions, 2 pages
    assert s.pool.used == 2
    held = []
    while 0 not in m.finish:
        m.step()
        held.append(s.pool.used)
    # Decode writes positions 5..15 (the last one ends it): a third page at 8, a fourth at 12.
    assert held == [2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 0]
    assert m.tokens[0] == alone([1, 2, 3, 4, 5], 12) and m.finish[0] is FinishReason.LENGTH


def test_the_youngest_is_preempted_then_resumed_from_the_cached_prompt_without_a_repeated_token():
    s = scheduler(pages=6)  # 24 positions: two requests of 5 + 11 tokens each need 8 pages
    m = FakeModel(s)
    a, b = req(0, [1, 2, 3, 4, 5], max_tokens=11), req(1, [6, 7, 6, 7, 6], max_tokens=11)
    s.add(a)
    s.add(b)
    preempted_at = None
    for step in range(60):
        plan = m.step()
        if plan.preempted:
            assert plan.preempted == (b,) and preempted_at is None  # the younger, once
            preempted_at = step
            assert s.waiting == 1 and s.running == 1 and s.preemptions == 1
            # b's one full prompt page joined the prefix cache; its decode pages are free.
            assert s.pool.cached_unreferenced == 1
        if preempted_at is not None and step == preempted_at + 1:
            assert s.waiting == 1  # a holds 4 pages and needs a 5th soon: b waits for room
        if len(m.finish) == 2:
            break
    assert preempted_at is not None
    assert m.tokens[0] == alone(a.prompt, 11) and m.tokens[1] == alone(b.prompt, 11)
    assert m.finish == {0: FinishReason.LENGTH, 1: FinishReason.LENGTH}
    assert s.pool.used == 0 and s.running == 0 and s.waiting == 0
    s.pool.check()


def test_a_resumed_request_prefills_its_fed_back_tokens_and_yields_no_token_for_it():
    s = scheduler(pages=6, chunk=3)
    m = FakeModel(s)
    a, b = req(0, [1, 2, 3, 4, 5], max_tokens=11), req(1, [6, 7, 6, 7, 6], max_tokens=11)
    s.add(a)
    s.add(b)
    resumed = []
    while len(m.finish) < 2:
        before = list(m.tokens.get(1, []))
        plan = m.step()
        for call in plan.prefills:
            (p,) = call.rows
            if p.resumed is not None:
                resumed.append((p.start, p.end, len(before)))
                assert p.sequence == b.prompt + before[:-1] and not p.last
                assert m.tokens.get(1, []) == before  # that prefill delivered nothing
    # Resumed in chunks of 3 from its cached first page (4 positions) up to what it had fed back.
    starts = [r[0] for r in resumed]
    assert starts[0] == PS and all(e - st <= 3 for st, e, _ in resumed)
    assert resumed[-1][1] == len(b.prompt) + resumed[0][2] - 1
    assert m.tokens[1] == alone(b.prompt, 11)


def test_admission_keeps_a_page_of_growth_for_each_running_request():
    s = scheduler(pages=5, batch=3)
    m = FakeModel(s)
    s.add(req(0, [1, 2, 3], max_tokens=5))  # 1 page (positions 0-3)
    s.add(req(1, [4, 5, 6], max_tokens=5))  # 1 page
    s.add(req(2, [7, 8, 9, 1, 2, 3, 4], max_tokens=2))  # 2 pages: 2 + 2 running > 5 - 2 free
    m.step()
    assert s.running == 2 and s.waiting == 1 and s.pool.used == 2
    while len(m.finish) < 3:
        m.step()
        assert s.preemptions == 0
    assert all(m.tokens[i] == alone(q, n) for i, (q, n) in enumerate([([1, 2, 3], 5), ([4, 5, 6], 5), ([7, 8, 9, 1, 2, 3, 4], 2)]))


def test_a_cancelled_preempted_request_leaves_the_queue_and_its_state():
    s = scheduler(pages=6)
    m = FakeModel(s)
    a, b = req(0, [1, 2, 3, 4, 5], max_tokens=11), req(1, [6, 7, 6, 7, 6], max_tokens=11)
    s.add(a)
    s.add(b)
    while not s.preemptions:
        m.step()
    b.cancel()
    m.step()
    assert m.finish[1] is FinishReason.CANCELLED and s._resumed == {} and s.waiting == 0
    while 0 not in m.finish:
        m.step()
    assert m.tokens[0] == alone(a.prompt, 11) and m.tokens[1] == alone(b.prompt, 11)[: len(m.tokens[1])]
    assert s.pool.used == 0
    s.pool.check()


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(1, 3), min_size=0, max_size=10), st.integers(1, 14), st.one_of(st.none(), st.integers(0, 8))),
        min_size=1, max_size=10,
    ),
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(0, 6),
)
def test_every_request_equals_itself_alone_whatever_the_pool_forces(specs, batch, chunk, spare):
    """Random prompts sharing stems (so prefixes are cached and shared), random lengths and
    cancellations, over a pool between the largest request and a few pages more: preemptions,
    evictions and waits happen, and every request's tokens equal its run alone (a cancelled one
    a prefix of them); at the end no page is held and the books agree."""
    requests = []
    for i, (tail, max_tokens, cancel_at) in enumerate(specs):
        prompt = [1, 2, 3, 1, 2][: 1 + i % 5] + tail
        requests.append((req(i, prompt, max_tokens), cancel_at))
    largest = max(-(-(q.prompt_tokens + q.params.max_tokens) // PS) for q, _ in requests)
    s = scheduler(pages=largest + spare, batch=batch, chunk=chunk)
    m = FakeModel(s)
    for q, _ in requests:
        s.add(q)
    for step in range(2000):
        for q, cancel_at in requests:
            if cancel_at is not None and step == cancel_at:
                q.cancel()
        plan = m.step()
        if not plan.runs_model and s.waiting == 0 and s.running == 0:
            break
    else:
        raise AssertionError("the requests did not finish in 2000 steps")
    for q, cancel_at in requests:
        want = alone(q.prompt, q.params.max_tokens)
        got = m.tokens.get(q.id, [])
        if m.finish[q.id] is FinishReason.LENGTH:
            assert got == want
        else:
            assert m.finish[q.id] is FinishReason.CANCELLED and cancel_at is not None and got == want[: len(got)]
    assert s.pool.used == 0 and s._resumed == {}
    s.pool.check()
