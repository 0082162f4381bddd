"""Continuous batching over a compiled model: requests join and leave a fixed batch of cache
rows between decode steps.

One background thread owns the model and its batch-``B`` KV cache. Between steps it admits
waiting requests into free rows, then runs one ``decode_bs{B}`` step for every row, each at
its own position, samples each busy row's next token with the request's own
:class:`~sharktank.text.sampling.Sampler`, delivers the events and frees the rows of
finished or cancelled requests.

Admission policy: between two decode steps, every waiting request that has a free row
(first come, first served) is prefilled together (``CompiledModel.prefill_rows``: each
prompt's keys and values go into its own row only, the rows already generating keep their
caches): one batch-``B`` call when they fill more than half the rows, else one one-row
``prefill_row`` call each. So a row already decoding waits at most a batch-``B`` prefill's
work per token, and requests that arrive together wait for that, not for each other's
decoding. Requests that find no free row wait in the queue, in order, for the next step
that frees one.

Free rows decode a dummy token at position 0. That write can never reach a later occupant
of the row, because of the causal mask (``layers.attention.causal_mask``): a query at
position ``p`` attends only to cache entries ``0..p``, and each call writes its own entries
before it attends (``attention`` does the ``index_put`` first). A new occupant's prefill
overwrites entries ``0..S-1``, and each later step writes entry ``p`` before reading up to
``p``, so every entry it can see is its own; what a previous or dummy occupant left at
``p' > p`` is masked out, and every row's computation (norms, products, attention) stays
within the row.

The model is anything with :class:`~sharktank.runtime.compiled.PrefillDecode`'s interface:
a :class:`CompiledModel`, or rank 0's ``DistributedModel`` of a multi-host artifact, which
sends each call down the pipeline of hosts. When the loop has nothing to run it calls
``model.idle()`` (which keeps such a pipeline's connections alive). A :class:`ModelLost`
from any call ends the engine: every request fails with that error, later submits raise,
and :attr:`Engine.failure` says why (the server then stops).
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.compiled import InputError, ModelLost, PrefillDecode
from ..text.sampling import Sampler, SamplingParams

__all__ = ["QueueFull", "Event", "Request", "Engine"]

# How long the idle loop sleeps between looks at the queue and the stop flag (a submit or a
# cancel wakes it at once); stop() waits at most STOP_TIMEOUT_S for the thread.
IDLE_WAIT_S = 0.05
STOP_TIMEOUT_S = 1.0


class QueueFull(Exception):
    """``max_queue`` requests are already waiting for a row."""


@dataclass(frozen=True)
class Event:
    """One generated token (``finish_reason`` None while generating), or the end of a request:
    ``"stop"`` (a stop token, the event's token), ``"length"`` (``max_tokens`` reached),
    ``"cancelled"`` or ``"error"`` (then ``token`` is None and ``error`` says why)."""

    token: int | None
    finish_reason: str | None
    error: str | None = None


class Request:
    """A submitted request; :meth:`cancel` ends it (thread-safe)."""

    def __init__(self, id: int, prompt: list[int], params: SamplingParams, on_event: Callable[[Event], None], wake: threading.Event):
        self.id = id
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.params = params
        self.on_event = on_event
        self._wake = wake
        self._cancelled = threading.Event()
        self.done = False  # set on the engine thread when the last event was delivered

    def cancel(self) -> None:
        """End the request: its row is freed before the next step, and its last event has
        finish reason ``"cancelled"`` (nothing happens once it has finished)."""
        self._cancelled.set()
        self._wake.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __repr__(self) -> str:
        return f"Request(id={self.id}, prompt_tokens={self.prompt_tokens})"


@dataclass
class _Row:
    request: Request
    sampler: Sampler
    position: int  # where the next decode step writes (the last token's position)
    last: int  # the last token generated, the next step's input
    generated: int = 1


class Engine:
    """Continuous batching of :class:`Request` s over ``batch_size`` cache rows of ``model``."""

    def __init__(self, model: PrefillDecode, *, batch_size: int | None = None, max_queue: int = 64):
        functions = model.functions
        sizes = sorted(b for b in {f.batch_size for f in functions.values()} if model.find("decode", b) and (b == 1 or model.find("prefill_row", b)))
        if not sizes:
            raise InputError(f"{model.directory}: no batch size with decode and prefill_row functions; found functions {sorted(functions)}")
        batch_size = sizes[-1] if batch_size is None else batch_size
        if batch_size not in sizes:
            raise InputError(f"batch_size must be an exported batch size {sizes}, found {batch_size!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, found {max_queue!r}")
        self.model = model
        self.batch_size = batch_size
        self.max_queue = max_queue
        self.max_seq_len = model.find("decode", batch_size).max_seq_len
        self.vocab_size = model.vocab_size
        self._cache = model.new_cache(batch_size)
        self._rows: list[_Row | None] = [None] * batch_size
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()  # guards _queue and _stopped
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # set when a ModelLost ended the engine

    # --- control ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop on a background thread."""
        if self._thread is not None:
            raise RuntimeError("the engine was started already (an engine runs once: make a new one)")
        self._thread = threading.Thread(target=self._loop, name="sharktank-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the step loop (within about a second unless a model call takes longer); requests
        not finished get a last event with finish reason ``"error"``."""
        with self._lock:
            self._stopped = True
        self._stopping.set()
        self._wake.set()
        if self._thread is None:
            self._fail_all("the engine stopped before this request finished")  # never started: no thread to do it
        elif self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prompt: list[int], params: SamplingParams, on_event: Callable[[Event], None]) -> Request:
        """Queue a request; ``on_event`` is called on the engine thread with one :class:`Event`
        per token, the last with its finish reason. Raises :class:`InputError` for a prompt
        the model cannot take and :class:`QueueFull` when ``max_queue`` requests wait."""
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, found {type(params).__name__}")
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InputError(f"the prompt must be a non-empty list of token ids, found {prompt!r:.80}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InputError(f"token ids must be integers, found {sorted({type(t).__name__ for t in prompt})}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(f"token ids must be in [0, {self.vocab_size}), found {bad[:5]}")
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise InputError(
                f"a prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} is {len(prompt) + params.max_tokens}, "
                f"past the exported cache length {self.max_seq_len}"
            )
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"the engine stopped: {self.failure}" if self.failure else "the engine is stopped")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (max_queue {self.max_queue})")
            request = Request(next(self._ids), list(prompt), params, on_event, self._wake)
            self._queue.append(request)
        self._wake.set()
        return request

    # --- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        why = "the engine stopped before this request finished"
        try:
            while not self._stopping.is_set():
                self._retire_cancelled()
                self._admit()
                self._retire_cancelled()  # a cancel during admission frees its row before the step
                if any(self._rows):
                    self._step()
                else:
                    self.model.idle()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except ModelLost as e:  # the model takes no more calls: every request ends with why
            why = self.failure = f"the model was lost: {e}"
        finally:  # stopped, or a bug ended the loop: no request may wait for it
            with self._lock:
                self._stopped = True
            self._fail_all(why)

    def _retire_cancelled(self) -> None:
        for r, row in enumerate(self._rows):
            if row is not None and row.request.cancelled:
                self._finish(r, Event(None, "cancelled"))
        with self._lock:
            cancelled = [q for q in self._queue if q.cancelled]
            for q in cancelled:
                self._queue.remove(q)
        for q in cancelled:
            self._deliver(q, Event(None, "cancelled"))

    def _admit(self) -> None:
        """Prefill the waiting requests that have free rows, first come first served (prefill_rows)."""
        free = [r for r, row in enumerate(self._rows) if row is None]
        taken: list[Request] = []
        with self._lock:
            while self._queue and len(taken) < len(free):
                taken.append(self._queue.popleft())
        admitted = []
        for request in taken:
            if request.cancelled:
                self._deliver(request, Event(None, "cancelled"))
            else:
                admitted.append(request)
        if not admitted:
            return
        rows = free[: len(admitted)]
        try:
            logits, self._cache = self.model.prefill_rows([q.prompt for q in admitted], rows, self._cache)
        except ModelLost:
            with self._lock:
                self._queue.extendleft(reversed(admitted))  # failed with the others by the loop
            raise
        except Exception as e:  # these requests fail; the rows they were given stay free
            for request in admitted:
                self._deliver(request, Event(None, "error", f"prefill failed: {type(e).__name__}: {e}"))
            return
        for request, r, out in zip(admitted, rows, logits):
            try:
                sampler = Sampler(request.params)
                token = sampler.next_token(out[-1])
            except Exception as e:  # this request fails; its row stays free
                self._deliver(request, Event(None, "error", f"prefill failed: {type(e).__name__}: {e}"))
                continue
            self._rows[r] = _Row(request, sampler, position=request.prompt_tokens, last=token)
            self._emit(r, token)

    def _step(self) -> None:
        """One decode step for every row (free rows: a dummy token at position 0)."""
        busy = [r for r, row in enumerate(self._rows) if row is not None]
        tokens = torch.tensor([row.last if row else 0 for row in self._rows], dtype=torch.int64)
        positions = torch.tensor([row.position if row else 0 for row in self._rows], dtype=torch.int64)
        try:
            logits, self._cache = self.model.decode(tokens, self._cache, positions)
        except ModelLost:
            raise
        except Exception as e:  # every busy row took part: they all fail
            for r in busy:
                self._finish(r, Event(None, "error", f"decode failed: {type(e).__name__}: {e}"))
            return
        for r in busy:
            row = self._rows[r]
            try:
                token = row.sampler.next_token(logits[r, -1])
            except Exception as e:
                self._finish(r, Event(None, "error", f"sampling failed: {type(e).__name__}: {e}"))
                continue
            row.position += 1
            row.last = token
            row.generated += 1
            self._emit(r, token)

    def _emit(self, r: int, token: int) -> None:
        """Deliver row ``r``'s new token, ending the request on a stop token or at max_tokens."""
        row = self._rows[r]
        params = row.request.params
        reason = "stop" if token in params.stop_token_ids else "length" if row.generated >= params.max_tokens else None
        if reason is not None:
            self._finish(r, Event(token, reason))
        elif not self._deliver(row.request, Event(token, None)):
            self._rows[r] = None

    def _finish(self, r: int, event: Event) -> None:
        request = self._rows[r].request
        self._rows[r] = None
        self._deliver(request, event)

    def _deliver(self, request: Request, event: Event) -> bool:
        """Call the request's ``on_event``; False (and the request ended) if the request is
        already done or its callback raised: a caller's bug must not stop the engine."""
        if request.done:
            return False
        request.done = event.finish_reason is not None
        try:
            request.on_event(event)
            return True
        except Exception as e:
            if not request.done:
                request.done = True
                try:
                    request.on_event(Event(None, "error", f"on_event raised {type(e).__name__}: {e}"))
                except Exception:
                    pass
            return False

    def _fail_all(self, why: str) -> None:
        for r, row in enumerate(self._rows):
            if row is not None:
                self._finish(r, Event(None, "error", why))
        with self._lock:
            waiting = list(self._queue)
            self._queue.clear()
        for q in waiting:
            self._deliver(q, Event(None, "error", why))
