"""The batching policy as plain state transitions, tested without threads or sleeps.

Each engine step is *decide, execute, update*: :meth:`Scheduler.schedule` returns a
:class:`~sharktank.serving.plan.StepPlan`, the engine runs it on the model and hands what
came back to :meth:`Scheduler.update`, which returns the events to deliver. Neither method
blocks, sleeps or touches the model; the engine holds its lock around them (``add`` comes
from other threads).

Policy:

- **Admission**: first come, first served. Each step, cancelled requests leave (their rows
  free at once), then waiting requests take the free rows, lowest row first, until either
  runs out. A request that finds no row waits, in order; :meth:`add` refuses one past
  ``max_queue`` (:class:`QueueFull`).
- **Prefill** (:func:`prefill_calls`): the requests admitted in one step are prefilled in one
  batched call when they fill more than half the rows (and the model has a batched prefill),
  else in one one-row call each: a batched call costs a batch-``B`` prefill of the longest
  prompt, which is the cheaper choice only when most rows take part.
- **Decode**: one step for every row that already has its first token; rows admitted this
  step join from the next (their first token comes from the prefill). Rows not decoding run a
  dummy token at the position their next real write overwrites first (a free row: 0; a row
  prefilled this step: its prompt's length), so the causal mask keeps it from ever being read.
- **Finish**: a stop token (``STOP``, the token delivered), ``max_tokens`` generated
  (``LENGTH``), a cancel (``CANCELLED``, no token) or an error of the step (``ERROR``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .events import EngineError, Event, FinishReason, QueueFull
from .plan import DecodeBatch, PrefillCall, PrefillRow, StepPlan, StepResults
from .request import Request

__all__ = ["Scheduler", "prefill_calls"]


@dataclass
class _Running:
    request: Request
    position: int  # where the next decode writes (the last token's position)
    last: int | None = None  # the last token generated; None until the prefill's result
    generated: int = 0


def prefill_calls(rows: list[PrefillRow], batch_size: int, batched: bool) -> tuple[PrefillCall, ...]:
    """The calls that prefill ``rows`` of a batch-``batch_size`` cache: one batched call when
    they are more than half the rows and ``batched`` (the model has that function), else one
    call per row."""
    if not rows:
        return ()
    if batched and 2 * len(rows) > batch_size:
        return (PrefillCall(tuple(rows)),)
    return tuple(PrefillCall((r,)) for r in rows)


class Scheduler:
    """Which requests hold which of ``batch_size`` cache rows, and what each step runs.
    ``batched_prefill``: whether the model can prefill several rows in one call."""

    def __init__(self, batch_size: int, *, max_queue: int, batched_prefill: bool):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        self.batch_size = batch_size
        self.max_queue = max_queue
        self.batched_prefill = batched_prefill
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[_Running | None] = [None] * batch_size

    @property
    def waiting(self) -> int:
        """Requests waiting for a row."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Rows holding a request."""
        return sum(r is not None for r in self._rows)

    def add(self, request: Request) -> None:
        """Queue ``request`` behind the others; :class:`QueueFull` when ``max_queue`` wait."""
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue {self.max_queue})")
        self._waiting.append(request)

    def schedule(self) -> StepPlan:
        """Retire cancelled requests, admit waiting ones into free rows and plan the step."""
        finished = self._retire_cancelled()
        decode = self._decode_batch()
        admitted = self._admit()
        if decode is not None:  # rows admitted now take the dummy at their prompt's end
            tokens, positions = list(decode.tokens), list(decode.positions)
            for p in admitted:
                positions[p.row] = p.end
            decode = DecodeBatch(tuple(tokens), tuple(positions), decode.requests)
        prefills = prefill_calls(admitted, self.batch_size, self.batched_prefill)
        return StepPlan(finished=tuple(finished), prefills=prefills, decode=decode)

    def update(self, results: StepResults) -> list[tuple[Request, Event]]:
        """Apply a step's results: each row's new token (ending its request at a stop token or
        at ``max_tokens``) or its error (ending it, its row freed). Returns the events to
        deliver, in row order."""
        events: list[tuple[Request, Event]] = []
        for r, run in enumerate(self._rows):
            if run is None:
                continue
            rid = run.request.id
            if rid in results.errors:
                self._rows[r] = None
                events.append((run.request, Event(None, FinishReason.ERROR, results.errors[rid])))
            elif rid in results.tokens:
                events.append((run.request, self._advance(r, run, results.tokens[rid])))
        return events

    def drop(self, request: Request) -> None:
        """Forget ``request`` (its caller was told already), freeing its row or queue place."""
        for r, run in enumerate(self._rows):
            if run is not None and run.request is request:
                self._rows[r] = None
        if request in self._waiting:
            self._waiting.remove(request)

    def drain(self, error: EngineError) -> list[tuple[Request, Event]]:
        """End every request, running then waiting, with ``error``; the scheduler is empty after."""
        ended = [run.request for run in self._rows if run is not None] + list(self._waiting)
        self._rows = [None] * self.batch_size
        self._waiting.clear()
        return [(q, Event(None, FinishReason.ERROR, error)) for q in ended]

    # --- the steps of schedule() and update() ---------------------------------------------------
    def _retire_cancelled(self) -> list[tuple[Request, Event]]:
        finished = []
        for r, run in enumerate(self._rows):
            if run is not None and run.request.cancelled:
                self._rows[r] = None
                finished.append((run.request, Event(None, FinishReason.CANCELLED)))
        for q in [q for q in self._waiting if q.cancelled]:
            self._waiting.remove(q)
            finished.append((q, Event(None, FinishReason.CANCELLED)))
        return finished

    def _decode_batch(self) -> DecodeBatch | None:
        live = [(r, run) for r, run in enumerate(self._rows) if run is not None and run.last is not None]
        if not live:
            return None
        tokens, positions = [0] * self.batch_size, [0] * self.batch_size
        for r, run in live:
            tokens[r], positions[r] = run.last, run.position
        return DecodeBatch(tuple(tokens), tuple(positions), tuple((run.request, r) for r, run in live))

    def _admit(self) -> list[PrefillRow]:
        admitted = []
        for r in range(self.batch_size):
            if not self._waiting:
                break
            if self._rows[r] is None:
                request = self._waiting.popleft()
                self._rows[r] = _Running(request, position=request.prompt_tokens)
                admitted.append(PrefillRow(request, r, 0, request.prompt_tokens))
        return admitted

    def _advance(self, r: int, run: _Running, token: int) -> Event:
        if run.last is not None:  # a decode result; a prefill's leaves the position at the prompt's end
            run.position += 1
        run.last = token
        run.generated += 1
        params = run.request.params
        reason = FinishReason.STOP if token in params.stop_token_ids else FinishReason.LENGTH if run.generated >= params.max_tokens else None
        if reason is not None:
            self._rows[r] = None
        return Event(token, reason)
