"""Chunked prefill and prefix reuse in the scheduler, with a test playing the model: a fake
cache (the token each row holds at each position) checks that every read sees exactly the
request's own tokens. No model, no threads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sharktank.serving.events import EngineError, ErrorKind, FinishReason
from sharktank.serving.plan import StepResults
from sharktank.serving.request import Request
from sharktank.serving.scheduler import Scheduler
from sharktank.text.sampling import SamplingParams

T = 32


def req(id: int, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(id, list(prompt), SamplingParams(max_tokens=max_tokens), on_event=lambda e: None)


def chunks(plan) -> list[tuple[int, int, int, int]]:
    """(request id, row, start, end) of every chunk in the plan."""
    return [(p.request.id, p.row, p.start, p.end) for call in plan.prefills for p in call.rows]


def test_a_long_prompt_is_prefilled_in_budgeted_chunks_while_a_stream_decodes():
    s = Scheduler(2, max_queue=4, batched_prefill=True, chunk_tokens=4, max_seq_len=T)
    s.add(req(0, [1, 2], max_tokens=9))
    assert chunks(s.schedule()) == [(0, 0, 0, 2)]
    s.update(StepResults(tokens={0: 5}))
    s.add(req(1, list(range(10, 20))))
    for start, end in ((0, 4), (4, 8), (8, 10)):
        plan = s.schedule()
        assert chunks(plan) == [(1, 1, start, end)]
        assert [(q.id, r) for q, r in plan.decode.requests] == [(0, 0)]  # the stream keeps going
        assert plan.decode.positions[1] == end  # the dummy goes where the next chunk writes first
        events = s.update(StepResults(tokens={0: 6, **({1: 7} if end == 10 else {})}))
        assert [q.id for q, _ in events] == ([0, 1] if end == 10 else [0])


def test_the_budget_is_shared_oldest_admission_first():
    s = Scheduler(3, max_queue=4, batched_prefill=True, chunk_tokens=5, max_seq_len=T)
    s.add(req(0, list(range(1, 8))))
    s.add(req(1, list(range(1, 4))))
    assert chunks(s.schedule()) == [(0, 0, 0, 5)]
    assert chunks(s.schedule()) == [(0, 0, 5, 7), (1, 1, 0, 3)]


def test_a_free_row_holding_a_prefix_is_reused():
    s = Scheduler(2, max_queue=4, batched_prefill=True, chunk_tokens=16, max_seq_len=T)
    s.add(req(0, [1, 2, 3, 4], max_tokens=2))
    s.schedule()
    s.update(StepResults(tokens={0: 7}))
    s.schedule()
    s.update(StepResults(tokens={0: 8}))  # done: the row holds the prompt and 7 (8 was never fed)
    assert s.running == 0 and s.held(0) == [1, 2, 3, 4, 7]
    s.add(req(1, [9, 9]))  # shares nothing: the row with nothing to lose
    s.add(req(2, [1, 2, 3, 4, 7, 5, 6]))  # row 0 holds its first 5 tokens: only 2 are prefilled
    assert chunks(s.schedule()) == [(1, 1, 0, 2), (2, 0, 5, 7)]
    s = Scheduler(2, max_queue=4, batched_prefill=True, chunk_tokens=16, max_seq_len=T)
    s._held[1] = [1, 2, 3, 4, 7]  # as a finished request leaves it
    s.add(req(2, [1, 2, 3, 4, 7, 5, 6]))  # row 1 holds its first 5 tokens: only 2 are prefilled
    s.add(req(3, [1, 2, 3]))  # the same prefix, but row 1 is taken: row 0, from scratch
    assert chunks(s.schedule()) == [(2, 1, 5, 7), (3, 0, 0, 3)]
    s = Scheduler(1, max_queue=4, batched_prefill=True, chunk_tokens=16, max_seq_len=T)
    s._held[0] = [1, 2, 3]
    s.add(req(4, [1, 2, 3]))  # the whole prompt cached: its last token is prefilled again
    assert chunks(s.schedule()) == [(4, 0, 2, 3)]


def test_a_failed_row_forgets_what_it_held():
    s = Scheduler(1, max_queue=4, batched_prefill=True, chunk_tokens=16, max_seq_len=T)
    s.add(req(0, [1, 2, 3]))
    s.schedule()
    (_, event), = s.update(StepResults(errors={0: EngineError(ErrorKind.PREFILL, "boom")}))
    assert event.finish_reason is FinishReason.ERROR and s.held(0) == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=12), st.integers(1, 6), st.booleans()), min_size=1, max_size=10),
    st.integers(1, 3),
    st.integers(1, 7),
)
def test_every_read_sees_the_requests_own_tokens(specs, batch, budget):
    """A fake model: ``cache[row][p]`` is the token written at position p. A chunk or decode at
    position p of a request reads entries 0..p, which must hold the request's tokens (prompt,
    then each token fed back), whatever dummies, earlier occupants and reuse left there."""
    s = Scheduler(batch, max_queue=len(specs), batched_prefill=True, chunk_tokens=budget, max_seq_len=T)
    cache = [[None] * T for _ in range(batch)]
    fed: dict[int, list[int]] = {}
    requests = []
    for i, (prompt, max_tokens, cancel) in enumerate(specs):
        q = req(i, [1, *prompt], max_tokens=max_tokens)  # a shared first token makes reuse common
        requests.append((q, cancel))
        s.add(q)
    for step in range(200):
        if step == 3:
            for q, cancel in requests:
                if cancel:
                    q.cancel()
        plan = s.schedule()
        if not plan.runs_model and s.waiting == 0 and s.running == 0:
            break
        got = {}
        for call in plan.prefills:
            for p in call.rows:
                seq = p.request.prompt
                assert cache[p.row][: p.start] == seq[: p.start]  # what the chunk attends to before its own
                cache[p.row][p.start : p.end] = seq[p.start : p.end]
                if p.last:
                    got[p.request.id] = 100 + p.request.id
                    fed[p.request.id] = list(seq)
        if got:
            s.update(StepResults(tokens=got))
            got = {}
        if plan.decode is not None:
            live = dict((r, q) for q, r in plan.decode.requests)
            for r, (tok, pos) in enumerate(zip(plan.decode.tokens, plan.decode.positions)):
                assert 0 <= pos < T
                if r in live:
                    q = live[r]
                    assert pos == len(fed[q.id]) and cache[r][:pos] == fed[q.id]
                    fed[q.id].append(tok)
                    got[q.id] = 100 + q.id
                cache[r][pos] = tok if r in live else -1  # a dummy
            s.update(StepResults(tokens=got))
    assert s.running == 0 and s.waiting == 0
