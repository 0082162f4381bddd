"""Continuous batching: prefill_row against the compiled single-prompt prefill and eager torch,
and the engine's outputs against CompiledModel.generate for each prompt alone."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from engine_artifact import T

from sharktank.export.artifact import export_artifact
from sharktank.models import load_model
from sharktank.runtime import CompiledModel
from sharktank.runtime.compiled import InputError, ModelLost
from sharktank.serving.engine import Engine, Event, QueueFull
from sharktank.text.sampling import SamplingParams

WAIT_S = 60.0


class Collect:
    """An ``on_event`` that keeps the events and says when the last one came."""

    def __init__(self, then=None):
        self.events: list[Event] = []
        self.done = threading.Event()
        self.then = then  # called with (self, event) on the engine thread

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if self.then:
            self.then(self, event)
        if event.finish_reason is not None:
            self.done.set()

    def wait(self) -> "Collect":
        assert self.done.wait(WAIT_S), f"no last event within {WAIT_S} s; got {self.events}"
        return self

    @property
    def ids(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def reason(self) -> str:
        return self.events[-1].finish_reason


def run_alone(engine: Engine, prompt, params) -> Collect:
    c = Collect()
    engine.submit(prompt, params, c)
    return c.wait()


def greedy(compiled, prompt, n) -> list[int]:
    return compiled.generate(torch.tensor([prompt]), n)[0][0].tolist()


def host(cache) -> list[np.ndarray]:
    return [np.array(a.to_host()) for a in cache]


PROMPTS = [[(7 * i + 3 * j + 1) % 256 for j in range(3 + (5 * i) % 11)] for i in range(8)]


# --- prefill_row ---------------------------------------------------------------------------
def test_prefill_row_matches_prefill_alone_and_touches_only_its_row(compiled):
    cache = compiled.new_cache(4)
    for r in range(4):  # every row holds some other prompt first
        _, cache = compiled.prefill_row(torch.tensor([PROMPTS[r + 4]]), r, cache)
    tokens = torch.tensor([PROMPTS[1]])
    alone, alone_cache = compiled.prefill(tokens)
    eager = load_model("toy-llama").prefill(tokens)
    s = tokens.shape[1]
    for r in (2, 0, 3):
        before = host(cache)
        logits, cache = compiled.prefill_row(tokens, r, cache)
        after = host(cache)
        assert torch.equal(logits, alone) and (logits - eager).abs().max().item() <= 1e-4
        for b, a, one in zip(before, after, host(alone_cache), strict=True):
            assert np.array_equal(np.delete(a, r, 0), np.delete(b, r, 0))  # other rows: byte-identical
            assert np.array_equal(a[r, :s], one[0, :s])  # the row: the prompt's keys and values
            assert np.array_equal(a[r, s:], b[r, s:])  # past the prompt: the row keeps what it held
    with pytest.raises(InputError, match=r"row must be an integer in \[0, 4\) for a batch-4 cache, found 4"):
        compiled.prefill_row(tokens, 4, cache)
    with pytest.raises(InputError, match=r"takes one prompt \(tokens \[1, S\]\), found tokens \[2, 3\]"):
        compiled.prefill_row(torch.zeros(2, 3, dtype=torch.int64), 0, cache)
    with pytest.raises(InputError, match="the cache matches no exported batch size"):
        compiled.prefill_row(tokens, 0, cache[:-1])
    with pytest.raises(InputError, match="past the exported cache length 32"):
        compiled.prefill_row(torch.zeros(1, T + 1, dtype=torch.int64), 0, cache)


def test_prefill_rows_match_each_prompt_alone_and_leave_other_rows(compiled):
    eager = load_model("toy-llama")
    first = [PROMPTS[4], PROMPTS[5], PROMPTS[6], PROMPTS[7]]  # every row holds a prompt first
    _, cache = compiled.prefill_rows(first, [0, 1, 2, 3], compiled.new_cache(4))
    before = host(cache)
    prompts, rows = [PROMPTS[3], PROMPTS[0], PROMPTS[2]], [3, 0, 2]  # lengths 7, 3 and 13; row 1 not admitted
    assert [len(p) for p in prompts] == [7, 3, 13]
    logits, cache = compiled.prefill_rows(prompts, rows, cache)
    after = host(cache)
    for prompt, r, got in zip(prompts, rows, logits, strict=True):
        tokens = torch.tensor([prompt])
        alone, alone_cache = compiled.prefill(tokens)
        assert got.shape == (len(prompt), 256)
        assert (got - alone[0]).abs().max().item() <= 1e-5 and (got - eager.prefill(tokens)[0]).abs().max().item() <= 1e-4
        s = len(prompt)
        for b, a, one in zip(before, after, host(alone_cache), strict=True):
            assert np.abs(a[r, :s] - one[0, :s]).max() <= 1e-5  # the row: its prompt's keys and values
            assert np.array_equal(a[r, s:], b[r, s:])  # past the prompt (padding): not written
    for b, a in zip(before, after, strict=True):
        assert np.array_equal(a[1], b[1])  # the row not admitted: byte-identical
    # Every row decodes on from its own prompt as eager does for that prompt alone.
    held = {0: PROMPTS[0], 1: PROMPTS[5], 2: PROMPTS[2], 3: PROMPTS[3]}
    nxt = torch.tensor([11, 12, 13, 14])
    got, _ = compiled.decode(nxt, cache, torch.tensor([len(held[r]) for r in range(4)]))
    for r in range(4):
        c = eager.new_cache(1, T)
        eager.prefill(torch.tensor([held[r]]), c)
        want = eager.decode(nxt[r : r + 1], c, torch.tensor([len(held[r])]))
        assert (got[r : r + 1] - want).abs().max().item() <= 1e-4
    with pytest.raises(InputError, match=r"rows must be distinct integers in \[0, 4\) for a batch-4 cache, found \[1, 1\]"):
        compiled.prefill_rows([[1], [2]], [1, 1], cache)
    with pytest.raises(InputError, match=r"takes as many rows as prompts \(at least one\), found 2 prompts and 1 rows"):
        compiled.prefill_rows([[1], [2]], [1], cache)
    with pytest.raises(InputError, match="past the exported cache length 32"):
        compiled.prefill_rows([[1], list(range(T + 1))], [0, 1], cache)



def test_prefill_rows_is_one_batched_call_whatever_the_count(compiled):
    """The runtime runs what it is asked (the scheduler chooses rows or a batch): two prompts
    of four rows are one prefill_rows call, equal to each prompt alone, other rows untouched."""
    _, cache = compiled.prefill_rows([PROMPTS[4], PROMPTS[5], PROMPTS[6], PROMPTS[7]], [0, 1, 2, 3], compiled.new_cache(4))
    before, calls = host(cache), {k: len(v) for k, v in compiled.timings.items()}
    prompts, rows = [PROMPTS[2], PROMPTS[0]], [1, 3]
    logits, cache = compiled.prefill_rows(prompts, rows, cache)
    after = host(cache)
    made = {k: len(v) - calls.get(k, 0) for k, v in compiled.timings.items()}
    assert {k: n for k, n in made.items() if n} == {"prefill_rows": 1}
    for prompt, r, got in zip(prompts, rows, logits, strict=True):
        alone, alone_cache = compiled.prefill(torch.tensor([prompt]))
        assert (got - alone[0]).abs().max().item() <= 1e-5
        for b, a, one in zip(before, after, host(alone_cache), strict=True):
            assert np.abs(a[r, : len(prompt)] - one[0, : len(prompt)]).max() <= 1e-5
    for b, a in zip(before, after, strict=True):
        assert np.array_equal(a[[0, 2]], b[[0, 2]])  # the rows not named: byte-identical


def test_prefill_row_tp2_pp2(tmp_path):
    model = load_model("toy-llama", tp=2, pp=2)
    # The kinds this test runs (prefill_chunk's transfers at tp2 pp2: tests/cli/test_export_run.py).
    manifest = export_artifact(model, tmp_path / "art", source="toy-llama", batch_sizes=(2,), max_seq_len=16,
                               functions=("prefill", "decode", "prefill_row", "prefill_rows"), page_size=4)
    # prefill_bs2's transfers (see tests/cli) and the row index from device 0 to 1, 2 and 3.
    # prefill_rows_bs2: prefill_bs2's, and the padding mask from device 0 to 1, 2 and 3;
    # the paged functions: decode_bs2's, and the page table from device 0 to 1, 2 and 3.
    # Each prefill also sends its kept positions to the last stage's devices 2 and 3.
    assert manifest.transfers == {
        "prefill_bs2": 23 + 2, "decode_bs2": 23, "prefill_row_bs2": 23 + 3 + 2, "prefill_rows_bs2": 23 + 3 + 2, "prefill_paged_bs1": 23 + 3 + 2,
        "decode_paged_bs2": 23 + 3,
    }
    assert [a.name for a in manifest.find("prefill_row", 2).args[:5]] == ["tokens", "positions", "row", "keep", "cache.0"]
    assert manifest.data["functions"]["prefill_row_bs2"]["results"][1] == {"name": "cache.0", "same_as_arg": 4}
    compiled = CompiledModel(tmp_path / "art", driver="local-sync")
    first, second = torch.tensor([[9, 8, 7, 6, 5]]), torch.tensor([[1, 2, 3]])
    _, cache = compiled.prefill_row(first, 0, compiled.new_cache(2))
    before = host(cache)
    logits, cache = compiled.prefill_row(second, 1, cache)
    assert (logits - model.prefill(second)).abs().max().item() <= 1e-4
    for b, a in zip(before, host(cache), strict=True):
        assert np.array_equal(a[0], b[0])
    # Both prompts again in one prefill_rows call (rows swapped) on the sharded cache.
    together, cache_rows = compiled.prefill_rows([second[0].tolist(), first[0].tolist()], [1, 0], compiled.new_cache(2))
    for got, prompt in zip(together, (second, first)):
        assert (got - model.prefill(prompt)[0]).abs().max().item() <= 1e-4
    for a, b in zip(host(cache_rows), host(cache), strict=True):  # the same keys and values as one by one
        assert np.abs(a[:, :5] - b[:, :5]).max() <= 1e-5 and np.array_equal(a[1, 3:], np.zeros_like(a[1, 3:]))
    # Both rows decode on from their own prompts as eager does for each alone.
    nxt = torch.tensor([11, 12])
    got, _ = compiled.decode(nxt, cache, torch.tensor([5, 3]))
    for r, prompt in enumerate((first, second)):
        c = model.new_cache(1, 16)
        model.prefill(prompt, c)
        want = model.decode(nxt[r : r + 1], c, torch.tensor([prompt.shape[1]]))
        assert (got[r : r + 1] - want).abs().max().item() <= 1e-4
    # The paged functions at tp2 x pp2: each stage's pool on its own devices, split by KV head.
    pool = compiled.new_pool(8)
    tables = ([5, 1], [2])
    for prompt, table in zip((first, second), tables):
        out, pool = compiled.prefill_paged(prompt[0].tolist(), 0, prompt.shape[1], table, pool)
        assert (out - model.prefill(prompt)[0]).abs().max().item() <= 1e-4
    got, pool = compiled.decode_paged(nxt.tolist(), [5, 3], list(tables), pool)
    for r, prompt in enumerate((first, second)):
        c = model.new_cache(1, 16)
        model.prefill(prompt, c)
        assert (got[r] - model.decode(nxt[r : r + 1], c, torch.tensor([prompt.shape[1]]))[0]).abs().max().item() <= 1e-4


# --- the engine ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_tokens", [None, 256, 3])
def test_concurrent_requests_match_each_alone(compiled, engines, chunk_tokens):
    # Expectations first: the test calls the model only while no engine does.
    lengths = [5 + (3 * i) % 9 for i in range(8)]
    want = [greedy(compiled, prompt, n) for prompt, n in zip(PROMPTS, lengths)]
    engine = engines(max_queue=16, chunk_tokens=chunk_tokens)
    assert engine.chunk_tokens == chunk_tokens  # the artifact has prefill_chunk
    assert (engine.batch_size, engine.max_seq_len, engine.vocab_size) == (4, T, 256)
    sampled = SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=5)
    alone = run_alone(engine, PROMPTS[2], sampled).ids
    collectors, order = [], []  # order: (request, event) as delivered
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):  # 8 requests for 4 rows: some wait
        collectors.append(Collect(lambda c, e, i=i: order.append((i, e))))
        engine.submit(prompt, SamplingParams(max_tokens=n), collectors[-1])
        if i == 5:
            together = Collect()
            engine.submit(PROMPTS[2], sampled, together)
    for w, c in zip(want, collectors):
        c.wait()
        assert c.reason == "length" and c.ids == w
        assert all(e.finish_reason is None for e in c.events[:-1])
    assert together.wait().ids == alone and len(alone) == 9
    # Continuous, not static, batching: request 4 starts when the first rows free up
    # (requests 0 and 3 take 5 tokens), while request 2 (11 tokens) still runs.
    first_of_4 = next(k for k, (i, _) in enumerate(order) if i == 4)
    last_of_2 = max(k for k, (i, _) in enumerate(order) if i == 2)
    assert first_of_4 < last_of_2


def test_requests_arriving_together_are_prefilled_in_one_call(compiled, engines):
    want = [greedy(compiled, PROMPTS[i], 6) for i in range(6)]
    batched, single = [], []  # the rows of each prefill_rows call; the row of each prefill_row call
    model = Hooked(Hooked(compiled, "prefill_rows", lambda n: None, record=batched), "prefill_row", lambda n: None, record=single)
    engine = engines(model=model, start=False, chunk_tokens=None)
    collectors = [Collect() for _ in range(6)]
    # 6 requests, 4 rows: 4 prefilled together, then 2 (half the rows) in one one-row call each
    for i, c in enumerate(collectors):
        engine.submit(PROMPTS[i], SamplingParams(max_tokens=6), c)
    engine.start()
    for w, c in zip(want, collectors):
        assert c.wait().ids == w
    assert batched == [[0, 1, 2, 3]] and single == [0, 1]


def test_reused_row_shows_nothing_of_its_previous_request(engines):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    fresh = run_alone(engines(), PROMPTS[0], params).ids
    engine = engines()
    long = run_alone(engine, PROMPTS[7], SamplingParams(max_tokens=T - len(PROMPTS[7])))  # row 0, to the cache's end
    assert long.reason == "length" and len(long.ids) == T - len(PROMPTS[7])
    assert run_alone(engine, PROMPTS[0], params).ids == fresh  # row 0 again


def test_a_prompt_sharing_a_finished_requests_tokens_prefills_only_the_rest(compiled, engines):
    starts = []  # the start of each prefill_chunk call
    engine = engines(model=Hooked(compiled, "prefill_chunk", lambda n: None, record=starts), batch_size=1)
    first = run_alone(engine, PROMPTS[3], SamplingParams(max_tokens=4)).ids
    follow = PROMPTS[3] + first[:2] + [(first[2] + 1) % 256]  # the row holds PROMPTS[3] and first[:3]
    want = greedy(compiled, follow, 5)
    assert run_alone(engine, follow, SamplingParams(max_tokens=5)).ids == want
    assert starts == [0, len(PROMPTS[3]) + 2]
    other = run_alone(engine, PROMPTS[5], SamplingParams(max_tokens=5)).ids  # nothing shared: from 0
    assert starts[-1] == 0 and other == greedy(compiled, PROMPTS[5], 5)


def test_stop_token_ends_with_reason_stop(compiled, engines):
    ids = greedy(compiled, PROMPTS[3], 8)
    k = 3 + next(i for i, t in enumerate(ids[3:]) if t not in ids[:3])  # first token not seen before
    c = run_alone(engines(), PROMPTS[3], SamplingParams(max_tokens=8, stop_token_ids=(ids[k],)))
    assert c.ids == ids[: k + 1] and c.reason == "stop" and c.events[-1].token == ids[k]


def test_cancel_frees_the_row_for_a_waiting_request(compiled, engines):
    want = {i: greedy(compiled, PROMPTS[i], 16 if i < 4 else 5) for i in range(5)}
    engine = engines(start=False)  # all queued first: rows 0-3 get requests 0-3
    long = SamplingParams(max_tokens=16)

    ended = []  # the requests in the order their last events came

    def log(c, event):
        if event.finish_reason is not None:
            ended.append(c)
        if c is running[1] and len(c.events) == 3:
            c.request.cancel()

    running = [Collect(log) for i in range(4)]
    waiting, dropped = Collect(log), Collect(log)
    for i, c in enumerate(running):
        c.request = engine.submit(PROMPTS[i], long, c)
    dropped_request = engine.submit(PROMPTS[5], long, dropped)
    dropped_request.cancel()  # cancelled while queued: no token
    engine.submit(PROMPTS[4], SamplingParams(max_tokens=5), waiting)
    engine.start()
    assert dropped.wait().events == [Event(None, "cancelled")]
    cancelled = running[1].wait()
    assert cancelled.ids == want[1][:3] and cancelled.events[-1] == Event(None, "cancelled")
    # The freed row takes the waiting request while the other three still run.
    assert waiting.wait().ids == want[4]
    for i, c in enumerate(running):
        if i != 1:
            assert c.wait().ids == want[i]
    assert ended[:3] == [dropped, running[1], waiting]


def test_submit_refuses_what_the_model_cannot_take(engines):
    engine = engines(start=False, max_queue=2)
    ok = SamplingParams(max_tokens=4)
    for prompt, params, message in [
        ([], ok, "the prompt must be a non-empty list of token ids"),
        ([1, 256], ok, r"token ids must be in \[0, 256\), found \[256\]"),
        ([-1, 2], ok, r"token ids must be in \[0, 256\), found \[-1\]"),
        ([1, 2.0], ok, r"token ids must be integers, found \['float', 'int'\]"),
        (list(range(T + 1)), ok, "a prompt of 33 tokens plus max_tokens 4 is 37, past the exported cache length 32"),
        ([1, 2, 3], SamplingParams(max_tokens=30), "a prompt of 3 tokens plus max_tokens 30 is 33, past the exported cache length 32"),
    ]:
        with pytest.raises(InputError, match=message):
            engine.submit(prompt, params, Collect())
    queued = [Collect(), Collect()]
    for c in queued:
        engine.submit([1, 2], ok, c)
    with pytest.raises(QueueFull, match=r"2 requests are waiting \(max_queue 2\)"):
        engine.submit([1, 2], ok, Collect())
    engine.stop()  # never started: the waiting requests end at once
    for c in queued:
        assert c.done.is_set() and c.events == [Event(None, "error", "the engine stopped before this request finished")]
    with pytest.raises(RuntimeError, match="the engine is stopped"):
        engine.submit([1, 2], ok, Collect())
    with pytest.raises(InputError, match=r"batch_size must be an exported batch size \[1, 4\], found 2"):
        Engine(engine.model, batch_size=2)


class Hooked:
    """The compiled model, with ``hook(n)`` run before its ``n``-th call of ``name``
    (``record``: a list that gets each call's second argument: the rows of ``prefill_rows``,
    the start of ``prefill_chunk``)."""

    def __init__(self, model, name: str, hook, record: list | None = None):
        self.model, self.name, self.hook, self.calls, self.record = model, name, hook, 0, record

    def __getattr__(self, attr):
        fn = getattr(self.model, attr)
        if attr != self.name:
            return fn

        def call(*args, **kwargs):
            self.calls += 1
            self.hook(self.calls)
            if self.record is not None:
                self.record.append(list(args[1]) if isinstance(args[1], (list, tuple)) else args[1])
            return fn(*args, **kwargs)

        return call


def test_stop_ends_the_loop_within_a_second(compiled, engines):
    engine = engines(model=Hooked(compiled, "decode", lambda n: time.sleep(0.05)))  # slow steps
    busy = [Collect() for _ in range(6)]
    for i, c in enumerate(busy):
        engine.submit(PROMPTS[i], SamplingParams(max_tokens=T - len(PROMPTS[i])), c)
    end = time.monotonic() + WAIT_S
    while len(busy[0].events) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    t0 = time.perf_counter()
    engine.stop()
    assert time.perf_counter() - t0 < 1.0 and not engine.running
    for c in busy:  # the running and the waiting requests are told the engine stopped
        assert c.done.is_set() and c.events[-1] == Event(None, "error", "the engine stopped before this request finished")
    assert len(busy[0].ids) >= 2 and not busy[5].ids


def _raise_at_first(n: int) -> None:
    if n == 1:
        raise RuntimeError("device lost (injected)")


@pytest.mark.parametrize("name", ["decode", "prefill_row", "prefill_chunk"])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(compiled, engines, name):
    want = greedy(compiled, PROMPTS[1], 4)
    engine = engines(model=Hooked(compiled, name, _raise_at_first), chunk_tokens=None if name == "prefill_row" else 4)
    failed = run_alone(engine, PROMPTS[0], SamplingParams(max_tokens=4))
    assert failed.events[-1] == Event(None, "error", f"{'decode' if name == 'decode' else 'prefill'} failed: RuntimeError: device lost (injected)")
    assert run_alone(engine, PROMPTS[1], SamplingParams(max_tokens=4)).ids == want


def test_a_raising_callback_ends_only_its_request(compiled, engines):
    want = greedy(compiled, PROMPTS[1], 10)
    engine = engines()

    def explode(c, event):
        if len(c.events) == 2:
            raise ValueError("client went away")

    bad, good = Collect(explode), Collect()
    engine.submit(PROMPTS[0], SamplingParams(max_tokens=10), bad)
    engine.submit(PROMPTS[1], SamplingParams(max_tokens=10), good)
    assert good.wait().ids == want
    assert bad.wait().events[-1] == Event(None, "error", "on_event raised ValueError: client went away") and len(bad.ids) == 2


def test_a_lost_model_ends_the_engine_and_every_request(compiled, engines):
    def lose(n):
        if n == 3:
            raise ModelLost("rank 1 closed its connection")

    engine = engines(model=Hooked(compiled, "decode", lose), batch_size=4, max_queue=8)
    running = [Collect() for _ in range(2)]
    for i, c in enumerate(running):
        engine.submit(PROMPTS[i], SamplingParams(max_tokens=8), c)
    for c in running:  # the third decode step lost the model: both rows fail with its words
        assert c.wait().events[-1] == Event(None, "error", "the model was lost: rank 1 closed its connection")
    deadline = time.monotonic() + WAIT_S
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.running and engine.failure == "the model was lost: rank 1 closed its connection"
    with pytest.raises(RuntimeError, match="the engine stopped: the model was lost: rank 1"):
        engine.submit([1, 2], SamplingParams(max_tokens=2), Collect())


def test_an_idle_engine_calls_idle_and_ends_when_it_loses_the_model(compiled, engines):
    calls = []

    def lose(n):
        calls.append(time.monotonic())
        if n == 5:
            raise ModelLost("no pong")

    engine = engines(model=Hooked(compiled, "idle", lose), batch_size=4)
    deadline = time.monotonic() + WAIT_S
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 5 and engine.failure == "the model was lost: no pong"
