"""The paged KV cache: the compiled paged functions against eager torch and the contiguous
functions, and the engine over a pool of pages (results equal each request alone, prefix
pages shared and bit-identical to a fresh prefill, requests waiting for pages or preempted
when the pool runs out, no page leaked)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_artifact import PAGE, T
from reliability.reltools import soak
from test_engine import PROMPTS, Collect, Hooked, greedy, run_alone

from sharktank.models import load_model
from sharktank.runtime.compiled import InputError
from sharktank.text.sampling import SamplingParams


def host(pool) -> list[np.ndarray]:
    return [np.array(a.to_host()) for a in pool]


# --- the compiled functions ----------------------------------------------------------------
def test_paged_chunks_and_decode_equal_eager_and_touch_only_their_pages(compiled):
    eager = load_model("toy-llama")
    prompt = [(11 * j + 5) % 256 for j in range(22)]  # 6 pages of 4, the last one partly
    assert (compiled.page_size, compiled.max_pages) == (PAGE, T // PAGE)
    pool = compiled.new_pool(16)
    pages = [9, 2, 11, 5, 7, 3]  # any pages, in any order
    before = host(pool)
    parts = []
    for start, end in ((0, 9), (9, 21), (21, 22)):  # a one-token last chunk too
        out, pool = compiled.prefill_paged(prompt, start, end, pages, pool)
        parts.append(out)
    got = torch.cat(parts)
    want = eager.prefill(torch.tensor([prompt]))[0]
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-4
    after = host(pool)
    others = [p for p in range(16) if p not in pages]
    for b, a in zip(before, after, strict=True):
        assert np.array_equal(a[others], b[others])  # pages not in the table: untouched
    # The same prompt whole, into other pages: every full page bit for bit the same.
    again = [0, 1, 4, 6, 8, 10]
    _, pool = compiled.prefill_paged(prompt, 0, len(prompt), again, pool)
    for a in host(pool):
        assert np.array_equal(a[pages[:5]], a[again[:5]])
    # Decode two sequences at once, each through its own table, against the eager model.
    nxt = [int(want[-1].argmax()), 17]
    short = PROMPTS[2]
    _, pool = compiled.prefill_paged(short, 0, len(short), [12, 13, 14, 15], pool)
    # Batch 4 (an exported size): rows 2 and 3 write a dummy token into a page no one reads now.
    logits, pool = compiled.decode_paged(nxt + [0, 0], [len(prompt), len(short), 0, 0], [pages, [12, 13, 14, 15], [10], [10]], pool)
    for r, (p, tok) in enumerate(zip((prompt, short), nxt)):
        cache = eager.new_cache(1, T)
        eager.prefill(torch.tensor([p]), cache)
        ref = eager.decode(torch.tensor([tok]), cache, torch.tensor([len(p)]))
        assert (logits[r] - ref[0]).abs().max().item() <= 1e-4


def test_paged_calls_refuse_bad_tables(compiled):
    pool = compiled.new_pool(4)
    with pytest.raises(InputError, match=r"page ids must be in \[0, 4\) for a pool of 4 pages, found \[0, 4\]"):
        compiled.prefill_paged(PROMPTS[1], 0, 5, [0, 4], pool)
    with pytest.raises(InputError, match=r"2 pages of 4 hold positions below 8, but position 8 is needed"):
        compiled.prefill_paged(list(range(9)), 0, 9, [0, 1], pool)
    with pytest.raises(InputError, match=r"one token, position and page table per row, found 1, 1 and 2"):
        compiled.decode_paged([1], [0], [[0], [1]], pool)
    with pytest.raises(InputError, match=r"no decode_paged function for batch size 3"):
        compiled.decode_paged([1, 2, 3], [0, 0, 0], [[0], [1], [2]], pool)
    with pytest.raises(InputError, match=r"takes a pool from new_pool"):
        compiled.decode_paged([1], [0], [[0]], compiled.new_cache(1))


# --- the engine over the pool ----------------------------------------------------------------
@pytest.mark.parametrize("chunk_tokens", [256, 3])
def test_paged_engine_results_equal_each_request_alone(compiled, engines, chunk_tokens):
    lengths = [5 + (3 * i) % 9 for i in range(8)]
    want = [greedy(compiled, prompt, n) for prompt, n in zip(PROMPTS, lengths)]
    engine = engines(paged=True, max_queue=16, chunk_tokens=chunk_tokens)
    assert (engine.page_size, engine.kv_pages) == (PAGE, 4 * T // PAGE)
    collectors = [Collect() for _ in PROMPTS]
    for prompt, n, c in zip(PROMPTS, lengths, collectors):  # 8 requests, 4 decode slots
        engine.submit(prompt, SamplingParams(max_tokens=n), c)
    for w, c in zip(want, collectors):
        assert c.wait().reason == "length" and c.ids == w
    stats = engine.stats()
    assert stats.kv_pages_used == 0 and stats.kv_pages_used + stats.kv_pages_cached + stats.kv_pages_free == stats.kv_pages


def test_a_shared_prefix_is_prefilled_once_and_gives_the_same_answers(compiled, engines):
    system = [(5 * j + 2) % 256 for j in range(13)]  # 3 full pages and one token
    prompts = [system + [40 + i, 41 + i] for i in range(3)]
    want = [greedy(compiled, p, 4) for p in prompts]
    starts = []
    engine = engines(model=Hooked(compiled, "prefill_paged", lambda n: None, record=starts), paged=True, batch_size=1)
    got = [run_alone(engine, p, SamplingParams(max_tokens=4)).ids for p in prompts]
    assert got == want
    # The first prefills from 0; the others find the system prompt's 3 full pages cached.
    assert starts == [0, 3 * PAGE, 3 * PAGE]
    assert engine.stats().prefix_cache_hit_tokens == 2 * 3 * PAGE


def test_requests_wait_for_pages_and_a_request_larger_than_the_pool_is_refused(compiled, engines):
    # A pool of 6 pages (24 positions) for requests that grow to 3 pages each: some wait for
    # pages (admission keeps a page of growth for each running request) or are preempted.
    engine = engines(paged=True, kv_pages=6)
    with pytest.raises(InputError, match=r"needs 7 KV-cache pages of 4 positions; the pool has 6"):
        engine.submit(PROMPTS[0], SamplingParams(max_tokens=25), Collect())
    params = SamplingParams(max_tokens=12 - len(PROMPTS[0]))
    want = greedy(compiled, PROMPTS[0], params.max_tokens)
    collectors = [Collect() for _ in range(5)]
    for c in collectors:
        engine.submit(PROMPTS[0], params, c)
    for c in collectors:
        assert c.wait().ids == want
    stats = engine.stats()
    assert (stats.kv_pages, stats.kv_pages_used, stats.waiting, stats.running) == (6, 0, 0, 0)


def test_a_pool_that_runs_out_preempts_the_youngest_and_every_answer_equals_the_request_alone(compiled, engines):
    # 8 pages of 4 positions, 4 slots: prompts of 3-8 tokens admitted with 1-3 pages each, all
    # growing to 6-7 pages (max_tokens 20), so the pool runs out while every slot decodes and
    # the youngest requests are preempted, resumed later by prefilling prompt + fed-back tokens.
    # All are submitted before the engine starts, so its steps, and the preemptions, are the same
    # every run.
    engine = engines(paged=True, kv_pages=8, chunk_tokens=5, start=False)
    prompts = [PROMPTS[i] for i in (0, 1, 7, 5, 3)]
    n = 20
    wants = [greedy(compiled, p, n) for p in prompts]
    collectors = [Collect() for _ in prompts]
    for p, c in zip(prompts, collectors):
        engine.submit(p, SamplingParams(max_tokens=n), c)
    engine.start()
    for p, c, w in zip(prompts, collectors, wants):
        assert c.wait().reason == "length" and c.ids == w, p
    stats = engine.stats()
    assert stats.preemptions == 4
    assert (stats.kv_pages_used, stats.waiting, stats.running) == (0, 0, 0)
    engine._scheduler.pool.check()


def test_a_failed_chunk_frees_its_pages_and_registers_none(compiled, engines):
    def fail_first(n):
        if n == 1:
            raise RuntimeError("injected")

    engine = engines(model=Hooked(compiled, "prefill_paged", fail_first), paged=True, batch_size=1)
    failed = run_alone(engine, PROMPTS[7], SamplingParams(max_tokens=3))
    assert failed.reason == "error" and failed.ids == []
    assert engine.stats().kv_pages_used == 0 and engine.stats().kv_pages_cached == 0
    assert run_alone(engine, PROMPTS[7], SamplingParams(max_tokens=3)).ids == greedy(compiled, PROMPTS[7], 3)


def test_paged_needs_the_functions(compiled, engines, tmp_path):
    with pytest.raises(InputError, match=r"kv_pages needs a paged cache"):
        engines(paged=False, kv_pages=8, start=False)
    with pytest.raises(InputError, match=r"a paged cache needs chunked prefill"):
        engines(paged=True, chunk_tokens=None, start=False)


def test_decode_runs_the_smallest_exported_batch_holding_the_decoding_requests(compiled, engines):
    """Batch sizes 1 and 4 exported: one request decodes alone with decode_paged_bs1; three
    at once with decode_paged_bs4 (padded) while two or more decode; answers as alone."""
    rows = []  # the positions of each decode_paged call: one per row of the batch it ran
    engine = engines(model=Hooked(compiled, "decode_paged", lambda n: None, record=rows), paged=True, batch_size=4)
    assert run_alone(engine, PROMPTS[3], SamplingParams(max_tokens=5)).ids == greedy(compiled, PROMPTS[3], 5)
    assert rows and {len(r) for r in rows} == {1}
    rows.clear()
    want = [greedy(compiled, PROMPTS[i], 6) for i in (0, 4, 5)]
    got = [Collect() for _ in want]
    for i, c in zip((0, 4, 5), got):
        engine.submit(PROMPTS[i], SamplingParams(max_tokens=6), c)
    assert [c.wait().ids for c in got] == want
    assert 4 in {len(r) for r in rows} and {len(r) for r in rows} <= {1, 4}


def test_an_artifact_of_prefill_decode_and_pages_serves_paged_only(tmp_path_factory):
    """Batch 2 with no prefill_row (export --functions prefill,decode --page-size 8): the
    engine batches over the pool; the contiguous cache it cannot admit rows into is refused."""
    from toy_artifact import BATCH, toy_artifact

    from sharktank.runtime import CompiledModel
    from sharktank.serving.engine import Engine

    model = CompiledModel(toy_artifact(tmp_path_factory))
    assert model.find("prefill_row", BATCH) is None and model.find("decode_paged", BATCH) is not None
    engine = Engine(model)  # not started: the constructor chose the cache
    assert engine.batch_size == BATCH and engine.page_size is not None
    for kw in ({"paged": False}, {"chunk_tokens": None}):
        with pytest.raises(InputError, match=r"no batch size with decode and prefill_row functions \(or the paged ones\)"):
            Engine(model, **kw)


# --- a mixed load over a small pool (CI-sized; the soak runs 200) ----------------------------
def _mixed(seed: int, n: int):
    """``n`` (prompt, max_tokens, cancel_after) triples: prompts cut from 3 shared stems or not,
    half cancelled after 0, 1 or 2 tokens."""
    rng = random.Random(seed)
    stems = [[rng.randrange(256) for _ in range(14)] for _ in range(3)]
    out = []
    for _ in range(n):
        stem = stems[rng.randrange(3)] if rng.random() < 0.7 else []
        prompt = stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(256) for _ in range(rng.randrange(1, 6))]
        out.append((prompt, rng.randrange(1, min(12, T - len(prompt)) + 1), rng.choice([None, None, None, 0, 1, 2])))
    return out


def run_mixed(compiled, engines, seed: int, n: int, kv_pages: int) -> None:
    load = _mixed(seed, n)
    want = [greedy(compiled, p, m) for p, m, _ in load]  # expectations first: no engine runs yet
    engine = engines(paged=True, kv_pages=kv_pages, max_queue=n)
    collectors = []
    for prompt, max_tokens, cancel_after in load:
        def then(c, e, cancel_after=cancel_after):
            if cancel_after and len(c.ids) >= cancel_after and getattr(c, "request", None) is not None:
                c.request.cancel()

        c = Collect(then)
        c.request = engine.submit(prompt, SamplingParams(max_tokens=max_tokens), c)
        if cancel_after == 0:
            c.request.cancel()
        collectors.append(c)
    finished = 0
    for (prompt, max_tokens, cancel_after), w, c in zip(load, want, collectors):
        c.wait()
        if cancel_after is None:
            assert c.reason == "length" and c.ids == w, (prompt, max_tokens)
            finished += 1
        else:  # cancelled, or done before the cancel came: what came is the request's own
            assert c.reason in ("cancelled", "length") and c.ids == w[: len(c.ids)], (prompt, max_tokens)
    stats = engine.stats()
    assert (stats.waiting, stats.running, stats.kv_pages_used) == (0, 0, 0)  # no page leaked
    assert stats.kv_pages_cached + stats.kv_pages_free == kv_pages and stats.prefix_cache_hit_tokens > 0
    engine._scheduler.pool.check()  # the pool's books agree (free, cached, referenced, LRU)
    assert finished > n // 4  # half are never cancelled


def test_a_mixed_load_over_a_small_pool_equals_each_request_alone(compiled, engines):
    # 12 pages of 4 for 4 slots: requests wait for pages and cached prefixes are evicted.
    run_mixed(compiled, engines, seed=0, n=40, kv_pages=8)


@soak
def test_soak_mixed_load_over_a_small_pool(compiled, engines):
    run_mixed(compiled, engines, seed=1, n=200, kv_pages=8)


def test_kv_cache_gib_as_pages(compiled):
    # toy-llama: 4 blocks x (keys, values) x 4 positions x 4 KV heads x 8 dims x 4 bytes a page.
    assert compiled.page_bytes() == {0: 4 * 2 * PAGE * 4 * 8 * 4}
    assert compiled.pages_in(10 * 4096 / 2**30) == 10
    with pytest.raises(InputError, match=r"holds 1 KV-cache pages of 4096 bytes on the busiest device; at least 2 are needed"):
        compiled.pages_in(4096 / 2**30)
    from types import SimpleNamespace

    from sharktank.cli.common import CliError
    from sharktank.cli.serve import _kv_pages

    args = SimpleNamespace(kv_cache_gib=10 * 4096 / 2**30, prefill_chunk=256, dir="art")
    assert _kv_pages(args, compiled) == 10
    with pytest.raises(CliError, match=r"this host has .* GiB available"):
        _kv_pages(SimpleNamespace(**(args.__dict__ | {"kv_cache_gib": 1e6})), compiled)
    with pytest.raises(CliError, match=r"--kv-cache-gib needs chunked prefill"):
        _kv_pages(SimpleNamespace(**(args.__dict__ | {"prefill_chunk": None})), compiled)
