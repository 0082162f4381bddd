"""The batching policy on its own: Scheduler.schedule() plans, a test plays the model (tokens or
errors by request id), Scheduler.update() applies them. No model, no threads, no sleeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharktank.serving.events import EngineError, ErrorKind, Event, FinishReason, QueueFull
from sharktank.serving.plan import PrefillRow, StepPlan, StepResults
from sharktank.serving.request import Request
from sharktank.serving.scheduler import Scheduler, prefill_calls
from sharktank.text.sampling import SamplingParams


def req(id: int, prompt_len: int = 3, max_tokens: int = 4, stop: tuple[int, ...] = ()) -> Request:
    return Request(id, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop), on_event=lambda e: None)


def sched(batch: int = 4, max_queue: int = 8, batched: bool = True) -> Scheduler:
    return Scheduler(batch, max_queue=max_queue, batched_prefill=batched)


def prefilled(plan: StepPlan) -> list[tuple[int, int]]:
    """(request id, row) of every prefill in the plan, in call order."""
    return [(p.request.id, p.row) for call in plan.prefills for p in call.rows]


def decoded(plan: StepPlan) -> list[tuple[int, int]]:
    return [(q.id, r) for q, r in plan.decode.requests] if plan.decode else []


def tokens(**by_id: int) -> StepResults:
    return StepResults(tokens={int(k[1:]): v for k, v in by_id.items()})


# --- admission -----------------------------------------------------------------------------------
def test_admission_is_first_come_first_served_up_to_the_batch():
    s = sched(batch=2)
    for i in range(5):
        s.add(req(i))
    plan = s.schedule()
    assert prefilled(plan) == [(0, 0), (1, 1)] and plan.decode is None and not plan.finished
    assert (s.waiting, s.running) == (3, 2)
    assert s.schedule().prefills == ()  # no row free: nobody else is admitted
    s.update(tokens(r0=5, r1=6))
    plan = s.schedule()
    assert decoded(plan) == [(0, 0), (1, 1)] and plan.prefills == ()
    assert plan.decode.tokens == (5, 6) and plan.decode.positions == (3, 3)  # the prompts' ends


def test_a_freed_row_goes_to_the_oldest_waiting_request():
    s = sched(batch=2)
    for i, n in enumerate([1, 3, 3, 3]):
        s.add(req(i, max_tokens=n))
    s.schedule()
    (first, end), (second, more) = s.update(tokens(r0=5, r1=6))
    assert (first.id, end) == (0, Event(5, FinishReason.LENGTH)) and (second.id, more) == (1, Event(6, None))
    plan = s.schedule()
    assert prefilled(plan) == [(2, 0)] and decoded(plan) == [(1, 1)]
    # The row prefilled now decodes a dummy at its prompt's end, which its first real step
    # overwrites before anything reads it.
    assert plan.decode.positions == (3, 3) and plan.decode.tokens == (0, 6)


def test_max_queue_refuses_the_next_request():
    s = sched(batch=1, max_queue=2)
    s.add(req(0))
    s.add(req(1))
    with pytest.raises(QueueFull, match=r"2 requests are waiting \(max_queue 2\)"):
        s.add(req(2))
    s.schedule()  # one leaves the queue for the row: there is room again
    s.add(req(3))


# --- the prefill policy -------------------------------------------------------------------------
def _rows(n: int) -> list[PrefillRow]:
    return [PrefillRow(req(i), i, 0, 3) for i in range(n)]


@pytest.mark.parametrize(
    "n, batch, batched, calls",
    [
        (0, 4, True, []),
        (1, 4, True, [1]),
        (2, 4, True, [1, 1]),  # half the rows: one-row calls
        (3, 4, True, [3]),  # more than half: one batched call
        (4, 4, True, [4]),
        (4, 4, False, [1, 1, 1, 1]),  # no batched prefill exported
        (1, 1, True, [1]),
        (5, 8, True, [5]),
        (4, 8, True, [1, 1, 1, 1]),
    ],
)
def test_more_than_half_the_rows_prefill_in_one_batched_call(n, batch, batched, calls):
    got = prefill_calls(_rows(n), batch, batched)
    assert [len(c.rows) for c in got] == calls
    assert [p.row for c in got for p in c.rows] == list(range(n))  # every row once, in order


def test_admissions_of_one_step_share_the_policy():
    s = sched(batch=4)
    for i in range(3):
        s.add(req(i))
    assert [len(c.rows) for c in s.schedule().prefills] == [3]
    s2 = sched(batch=4)
    for i in range(2):
        s2.add(req(i))
    assert [len(c.rows) for c in s2.schedule().prefills] == [1, 1]


# --- finishing ----------------------------------------------------------------------------------
def test_length_ends_a_request_after_max_tokens():
    s = sched(batch=1)
    s.add(req(0, max_tokens=3))
    events = []
    for token in (10, 11, 12):
        s.schedule()
        events += [e for _, e in s.update(tokens(r0=token))]
    assert events == [Event(10, None), Event(11, None), Event(12, FinishReason.LENGTH)]
    assert s.running == 0 and s.schedule() == StepPlan()


def test_max_tokens_one_ends_at_the_prefill():
    s = sched(batch=1)
    s.add(req(0, max_tokens=1))
    s.schedule()
    assert [e for _, e in s.update(tokens(r0=9))] == [Event(9, FinishReason.LENGTH)] and s.running == 0


def test_a_stop_token_ends_with_stop_and_is_delivered():
    s = sched(batch=2)
    s.add(req(0, max_tokens=8, stop=(2,)))  # 2: the tokenizer's EOS, say
    s.add(req(1, max_tokens=8, stop=(2,)))
    s.schedule()
    first = s.update(tokens(r0=2, r1=5))  # request 0's first token is EOS
    assert [e for _, e in first] == [Event(2, FinishReason.STOP), Event(5, None)]
    plan = s.schedule()
    assert decoded(plan) == [(1, 1)] and plan.decode.positions == (0, 3)  # the freed row: a dummy at 0
    assert [e for _, e in s.update(tokens(r1=2))] == [Event(2, FinishReason.STOP)]
    assert s.running == 0


def test_finish_reasons_are_the_wire_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "cancelled", "error"]
    assert Event(1, FinishReason.STOP) == Event(1, "stop") and f"{FinishReason.LENGTH}" == "length"


# --- cancellation -------------------------------------------------------------------------------
def test_cancel_frees_the_row_before_the_next_step_and_skips_the_queue():
    s = sched(batch=2)
    running, other, queued, after = req(0), req(1), req(2), req(3)
    for q in (running, other, queued, after):
        s.add(q)
    s.schedule()
    s.update(tokens(r0=5, r1=6))
    running.cancel()
    queued.cancel()
    plan = s.schedule()
    assert [(q.id, e) for q, e in plan.finished] == [(0, Event(None, FinishReason.CANCELLED)), (2, Event(None, FinishReason.CANCELLED))]
    assert prefilled(plan) == [(3, 0)] and decoded(plan) == [(1, 1)]  # row 0 goes to the next in line
    assert s.waiting == 0


def test_a_cancel_after_the_last_event_changes_nothing():
    s = sched(batch=1)
    q = req(0, max_tokens=1)
    s.add(q)
    s.schedule()
    s.update(tokens(r0=4))
    q.cancel()
    assert s.schedule().finished == ()


# --- errors -------------------------------------------------------------------------------------
def test_an_error_ends_only_its_request_and_frees_its_row():
    s = sched(batch=2)
    for i in range(3):
        s.add(req(i, max_tokens=4))
    s.schedule()
    error = EngineError.of(ErrorKind.PREFILL, "prefill", RuntimeError("device lost"))
    events = s.update(StepResults(tokens={1: 7}, errors={0: error}))
    assert [(q.id, e) for q, e in events] == [(0, Event(None, FinishReason.ERROR, error)), (1, Event(7, None))]
    assert events[0][1].error.kind is ErrorKind.PREFILL and events[0][1].error == "prefill failed: RuntimeError: device lost"
    plan = s.schedule()
    assert prefilled(plan) == [(2, 0)] and decoded(plan) == [(1, 1)]
    sampling = EngineError(ErrorKind.SAMPLING, "sampling failed: ValueError: nan")
    events = s.update(StepResults(tokens={2: 3}, errors={1: sampling}))
    assert [(q.id, e.token, e.error and e.error.kind) for q, e in events] == [(2, 3, None), (1, None, ErrorKind.SAMPLING)]
    assert s.running == 1


def test_drain_ends_everyone_with_the_error_and_drop_forgets_one():
    s = sched(batch=1)
    for i in range(3):
        s.add(req(i))
    s.schedule()
    lost = EngineError(ErrorKind.MODEL_LOST, "the model was lost: no pong")
    s.drop(req(9))  # one it never had: nothing happens
    ended = s.drain(lost)
    assert [(q.id, e) for q, e in ended] == [(i, Event(None, FinishReason.ERROR, lost)) for i in range(3)]
    assert (s.waiting, s.running) == (0, 0)
    q = req(4)
    s.add(q)
    s.schedule()
    s.drop(q)  # its callback failed: the engine told it already
    assert s.running == 0 and s.schedule() == StepPlan()


# --- every policy together, against a stand-in model ---------------------------------------------
@settings(deadline=None)
@given(
    batch=st.sampled_from([1, 2, 4]),
    jobs=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5), st.booleans()), min_size=1, max_size=10),
    cancel_at=st.dictionaries(st.integers(0, 9), st.integers(0, 8), max_size=3),
)
def test_every_request_gets_its_tokens_once_and_rows_never_overlap(batch, jobs, cancel_at):
    """Requests (prompt length, max_tokens, stops at token 0?) against a model whose n-th token
    for a request is n: each ends once, in order of its own tokens, with the right reason."""
    s = sched(batch=batch, max_queue=len(jobs))
    requests = [req(i, p, m, stop=(3,) if stops else ()) for i, (p, m, stops) in enumerate(jobs)]
    for q in requests:
        s.add(q)
    got: dict[int, list[Event]] = {q.id: [] for q in requests}
    admitted: list[int] = []
    for step in range(200):
        for i, at in cancel_at.items():
            if i < len(requests) and at == step:
                requests[i].cancel()
        plan = s.schedule()
        for q, e in plan.finished:
            got[q.id].append(e)
        rows = [p.row for c in plan.prefills for p in c.rows] + [r for _, r in (plan.decode.requests if plan.decode else ())]
        assert len(rows) == len(set(rows)) and all(0 <= r < batch for r in rows)
        admitted += [p.request.id for c in plan.prefills for p in c.rows]
        if not plan.runs_model and not plan.finished:
            break
        ids = [p.request.id for c in plan.prefills for p in c.rows] + [q.id for q, _ in (plan.decode.requests if plan.decode else ())]
        for q, e in s.update(StepResults(tokens={i: len(got[i]) + 1 for i in ids})):
            got[q.id].append(e)
    assert s.running == 0 and s.waiting == 0
    assert admitted == sorted(admitted)  # first come, first served
    for q, (p, m, stops) in zip(requests, jobs):
        events = got[q.id]
        assert [e.finish_reason is not None for e in events] == [False] * (len(events) - 1) + [True]
        ids = [e.token for e in events if e.token is not None]
        assert ids == list(range(1, len(ids) + 1))
        last = events[-1].finish_reason
        if last is FinishReason.CANCELLED:
            assert q.cancelled and len(ids) < m
        elif stops and m >= 3:
            assert last is FinishReason.STOP and ids[-1] == 3
        else:
            assert last is FinishReason.LENGTH and len(ids) == m
