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
  dummy token at the position their next real write overwrites first (a free row: 0, or in
  chunked mode just past the tokens it holds; a row prefilled this step: its prompt's length,
  or its next chunk's start), so the causal mask keeps it from ever being read.
- **Chunked prefill and prefix reuse** (``chunk_tokens`` set: the model has ``prefill_chunk``):
  prompts are prefilled in chunks, at most ``chunk_tokens`` prompt tokens a step over all rows
  (the oldest admission first), so a long prompt admitted between decode steps delays the
  running streams by one chunk a step instead of its whole prefill; each chunk is its own
  one-row call and only the last yields the first token. Each row remembers the tokens whose
  entries it holds (a finished request's prompt and every token it fed back); a new request
  takes the free row holding the longest prefix of its prompt (on ties the row holding the
  fewest tokens, then the lowest, so a useful prefix is kept for whoever shares it) and
  prefills only the rest (at least its last token: the first token needs its logits), as
  llama.cpp's server reuses a slot's prompt. The reused entries are the ones an earlier
  prefill or decode computed for the same tokens: equal to a fresh prefill up to the
  rounding of a different batch shape, not bit for bit.
- **Finish**: a stop token (``STOP``, the token delivered), ``max_tokens`` generated
  (``LENGTH``), a cancel (``CANCELLED``, no token) or an error of the step (``ERROR``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .events import EngineError, Event, FinishReason, QueueFull
from .plan import DecodeBatch, PrefillCall, PrefillRow, StepPlan, StepResults
from .request import Request

__all__ = ["Scheduler", "prefill_calls", "DEFAULT_CHUNK_TOKENS"]

# Prompt tokens prefilled per step in chunked mode (the engine's and ``serve``'s default): a long
# prompt holds the running streams up by about one such prefill a step, not by its whole prefill.
DEFAULT_CHUNK_TOKENS = 256


@dataclass
class _Running:
    request: Request
    position: int  # where the next decode writes (the last token's position)
    last: int | None = None  # the last token generated; None until the prefill's result
    generated: int = 0
    prefilled: int = 0  # prompt tokens whose entries are written or planned (chunked prefill)
    outputs: list[int] = field(default_factory=list)  # every token generated, in order
    pages: object = None  # the paged scheduler's pages.Allocation of this request
    resumed: list[int] | None = None  # paged: what a preempted request prefills again when resumed
    age: int = 0  # paged: its admission order (the youngest is preempted first)

    def sequence(self) -> list[int]:
        """The tokens this request's prefill writes: its prompt, or once resumed after a
        preemption its prompt and the tokens it had fed back to decode."""
        return self.request.prompt if self.resumed is None else self.resumed

    def held(self) -> list[int]:
        """The tokens whose cache entries the row holds at positions 0, 1, ...: the prompt so far,
        then each generated token fed back to decode (all but the last)."""
        if self.prefilled < self.request.prompt_tokens or not self.outputs:
            return self.request.prompt[: self.prefilled]
        return self.request.prompt + self.outputs[:-1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
    ``batched_prefill``: whether the model can prefill several rows in one call.
    ``chunk_tokens``: the prompt tokens prefilled per step in chunked mode (None: whole prompts,
    no prefix reuse); it needs ``max_seq_len``, the cache length (where a free row's dummy
    decode may write)."""

    def __init__(self, batch_size: int, *, max_queue: int, batched_prefill: bool, chunk_tokens: int | None = None, max_seq_len: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
            raise ValueError(f"chunk_tokens must be an integer >= 1 or None, found {chunk_tokens!r}")
        if chunk_tokens is not None and (not isinstance(max_seq_len, int) or max_seq_len < 2):
            raise ValueError(f"chunked prefill needs the cache length max_seq_len (>= 2), found {max_seq_len!r}")
        self.chunk_tokens = chunk_tokens
        self.max_seq_len = max_seq_len
        # What each free row's cache holds (tokens at positions 0, 1, ...), for prefix reuse.
        self._held: list[list[int]] = [[] for _ in range(batch_size)]
        self._order: list[int] = []  # rows still prefilling, oldest admission first
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

    def held(self, row: int) -> list[int]:
        """The tokens whose cache entries ``row`` holds at positions 0, 1, ... (chunked mode)."""
        run = self._rows[row]
        return run.held() if run is not None else list(self._held[row])

    def schedule(self) -> StepPlan:
        """Retire cancelled requests, admit waiting ones into free rows and plan the step."""
        finished = self._retire_cancelled()
        decode = self._decode_batch()
        if self.chunk_tokens is not None:
            return self._schedule_chunks(finished, decode)
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
                self._free(r, held=[])  # what the failed call left in the row is unknown
                events.append((run.request, Event(None, FinishReason.ERROR, results.errors[rid])))
            elif rid in results.tokens:
                events.append((run.request, self._advance(r, run, results.tokens[rid])))
        return events

    def drop(self, request: Request) -> None:
        """Forget ``request`` (its caller was told already), freeing its row or queue place."""
        for r, run in enumerate(self._rows):
            if run is not None and run.request is request:
                self._free(r)
        if request in self._waiting:
            self._waiting.remove(request)

    def drain(self, error: EngineError) -> list[tuple[Request, Event]]:
        """End every request, running then waiting, with ``error``; the scheduler is empty after."""
        ended = [run.request for run in self._rows if run is not None] + list(self._waiting)
        self._rows = [None] * self.batch_size
        self._held = [[] for _ in range(self.batch_size)]
        self._order.clear()
        self._waiting.clear()
        return [(q, Event(None, FinishReason.ERROR, error)) for q in ended]

    # --- the steps of schedule() and update() ---------------------------------------------------
    def _retire_cancelled(self) -> list[tuple[Request, Event]]:
        finished = []
        for r, run in enumerate(self._rows):
            if run is not None and run.request.cancelled:
                self._free(r)
                finished.append((run.request, Event(None, FinishReason.CANCELLED)))
        for q in [q for q in self._waiting if q.cancelled]:
            self._waiting.remove(q)
            finished.append((q, Event(None, FinishReason.CANCELLED)))
        return finished

    def _decoding(self) -> list[tuple[int, _Running]]:
        """The rows with a token to feed back and no prefill left (a resumed request has its
        token before its prefill is done)."""
        return [(r, run) for r, run in enumerate(self._rows) if run is not None and run.last is not None and r not in self._order]

    def _decode_batch(self) -> DecodeBatch | None:
        live = self._decoding()
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
        run.outputs.append(token)
        params = run.request.params
        reason = FinishReason.STOP if token in params.stop_token_ids else FinishReason.LENGTH if run.generated >= params.max_tokens else None
        if reason is not None:
            self._free(r)
        return Event(token, reason)

    # --- chunked mode ------------------------------------------------------------------------------
    def _free(self, r: int, held: list[int] | None = None) -> None:
        """Row ``r`` leaves its request, remembering what its cache holds (for prefix reuse)."""
        run = self._rows[r]
        self._held[r] = run.held() if held is None and run is not None else list(held or [])
        self._rows[r] = None
        if r in self._order:
            self._order.remove(r)

    def _dummy_position(self, r: int) -> int:
        """Where a row that does not decode this step may take the decode's dummy write: a
        prefilling row at its next chunk's start (that chunk overwrites it before any read), a
        free row just past what it holds (its last held token is forgotten if it holds the
        whole cache)."""
        run = self._rows[r]
        if run is not None:
            return run.prefilled
        if len(self._held[r]) >= self.max_seq_len:
            self._held[r] = self._held[r][: self.max_seq_len - 1]
        return len(self._held[r])

    def _admit_reusing(self) -> None:
        """Waiting requests, oldest first, into the free rows holding the longest prefix of
        their prompts; each starts its prefill after that prefix (never past its last token)."""
        while self._waiting:
            free = [r for r in range(self.batch_size) if self._rows[r] is None]
            if not free:
                return
            request = self._waiting.popleft()
            reuse = {r: min(_common_prefix(self._held[r], request.prompt), request.prompt_tokens - 1) for r in free}
            r = max(free, key=lambda r: (reuse[r], -len(self._held[r]), -r))  # ties: lose the least cached
            self._rows[r] = _Running(request, position=request.prompt_tokens, prefilled=reuse[r])
            self._held[r] = []
            self._order.append(r)

    def _schedule_chunks(self, finished, decode: DecodeBatch | None) -> StepPlan:
        self._admit_reusing()
        budget, chunks = self.chunk_tokens, []
        for r in list(self._order):
            if budget == 0:
                break
            run = self._rows[r]
            length = len(run.sequence())
            end = min(length, run.prefilled + budget)
            resumed = None if run.resumed is None else tuple(run.resumed)
            chunks.append(PrefillRow(run.request, r, run.prefilled, end, resumed=resumed))
            budget -= end - run.prefilled
            run.prefilled = end
            if end == length:
                self._order.remove(r)
        if decode is not None:
            decoding = {r for _, r in decode.requests}
            positions = tuple(p if r in decoding else self._dummy_position(r) for r, p in enumerate(decode.positions))
            decode = DecodeBatch(decode.tokens, positions, decode.requests)
        return StepPlan(finished=tuple(finished), prefills=tuple(PrefillCall((c,)) for c in chunks), decode=decode)
