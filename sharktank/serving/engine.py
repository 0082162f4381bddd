"""Continuous batching over a compiled model: requests join and leave a fixed batch of cache
rows between decode steps.

One background thread owns the model and its batch-``B`` KV cache and loops: *decide* (the
:class:`~sharktank.serving.scheduler.Scheduler` plans the step: cancellations, admissions,
prefill calls, one decode step), *execute* (the plan's calls on the model; each request's
next token sampled with its own :class:`~sharktank.text.sampling.Sampler`), *update* (the
scheduler applies the tokens and errors and says which events to deliver). The prefill calls'
results are applied and delivered before the decode step runs, so a request's first token
waits for its own prefill only. Every policy (who
is admitted, batched or one-row prefill, when a request ends) is the scheduler's, in plain
state transitions; this module only runs plans and delivers events.

Free rows decode a dummy token at position 0, and a row prefilled in the step it joined at its
prompt's length. Such a write can never reach a later read of the row, because of the causal
mask (``layers.attention.causal_mask``): a query at position ``p`` attends only to cache
entries ``0..p``, and each call writes its own entries before it attends (``attention`` does
the ``index_put`` first). A new occupant's prefill overwrites entries ``0..S-1``, and each later
step writes entry ``p`` before reading up to ``p``, so every entry it can see is its own; what a
previous or dummy occupant left at ``p' > p`` is masked out, and every row's computation (norms,
products, attention) stays within the row.

With chunked prefill (the default where the artifact has ``prefill_chunk``) a row is not
prefilled afresh: it may keep a previous request's entries as a prefix the new prompt shares
(the scheduler's prefix reuse), and entries past what a row's request wrote are stale rather
than zero; the same causal-mask argument covers them, and a free row's dummy write goes just
past the tokens it holds (the scheduler's ``_dummy_position``), not to position 0.

The model is anything with :class:`~sharktank.runtime.compiled.PrefillDecode`'s interface:
a :class:`CompiledModel`, or rank 0's ``DistributedModel`` of a multi-host artifact, which
sends each call down the pipeline of hosts. When the loop has nothing to run it calls
``model.idle()`` (which keeps such a pipeline's connections alive). A :class:`ModelLost`
from any call ends the engine: every request fails with that error, later submits raise,
and :attr:`Engine.failure` says why (the server then stops).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.compiled import InputError, ModelLost, PrefillDecode
from ..text.sampling import Sampler, SamplingParams
from .events import EngineError, ErrorKind, Event, FinishReason, QueueFull
from .plan import DecodeBatch, PrefillCall, StepPlan, StepResults
from .request import Request
from .pages import PagePool
from .paged_scheduler import PagedScheduler
from .scheduler import DEFAULT_CHUNK_TOKENS, Scheduler

__all__ = ["QueueFull", "Event", "FinishReason", "EngineError", "ErrorKind", "Request", "EngineStats", "Engine"]

# How long the idle loop sleeps between looks at the queue and the stop flag (a submit or a
# cancel wakes it at once); stop() waits at most STOP_TIMEOUT_S for the thread.
IDLE_WAIT_S = 0.05
STOP_TIMEOUT_S = 1.0
_STOPPED = "the engine stopped before this request finished"



@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load: requests waiting for a row, rows in use, rows in all;
    with a paged cache its pages (in use by requests, cached for reuse and unreferenced, free:
    the three add up to ``kv_pages``), the prompt tokens the prefix cache supplied and the
    requests preempted to free pages, both since start (0 without one)."""

    waiting: int
    running: int
    batch_size: int
    kv_pages: int = 0
    kv_pages_used: int = 0
    kv_pages_cached: int = 0
    kv_pages_free: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0


class Engine:
    """Continuous batching of :class:`Request` s over ``batch_size`` cache rows of ``model``."""

    def __init__(
        self, model: PrefillDecode, *, batch_size: int | None = None, max_queue: int = 64, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
        kv_pages: int | None = None, paged: bool | None = None,
    ):
        """``chunk_tokens``: chunked prefill with prefix reuse, at most this many prompt tokens
        prefilled per step (:class:`~sharktank.serving.scheduler.Scheduler`), when the model has
        a ``prefill_chunk`` function for the batch size; None, or a model without one: whole
        prompts, each row prefilled afresh. With ``chunk_tokens`` and an artifact that has the
        paged functions (``export --page-size``) the cache is a pool of ``kv_pages`` pages
        (:class:`~sharktank.serving.paged_scheduler.PagedScheduler`; by default as many as the
        contiguous rows would take, ``batch_size * max_seq_len`` positions) plus one scratch
        page, and the contiguous cache is not allocated. ``paged``: False keeps the contiguous
        cache even then; True refuses an artifact without the paged functions; None (default):
        paged where it can be."""
        functions = model.functions

        def servable(b: int) -> bool:  # a row admitted by prefill_row (b > 1) or through the page pool
            paged_b = paged is not False and chunk_tokens is not None and model.find("decode_paged", b) and model.find("prefill_paged", 1)
            return bool(model.find("decode", b) and (b == 1 or model.find("prefill_row", b) or paged_b))

        sizes = sorted(b for b in {f.batch_size for f in functions.values()} if servable(b))
        if not sizes:
            raise InputError(
                f"{model.directory}: no batch size with decode and prefill_row functions (or the paged ones); found functions {sorted(functions)}"
            )
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
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
            raise ValueError(f"chunk_tokens must be an integer >= 1 or None, found {chunk_tokens!r}")
        paged_spec = model.find("prefill_paged", 1) if chunk_tokens is not None and model.find("decode_paged", batch_size) else None
        if paged and paged_spec is None:
            raise InputError(
                f"{model.directory}: a paged cache needs chunked prefill and the paged functions for batch size {batch_size} "
                "(export --page-size); found none"
            )
        paged = paged_spec if paged is not False else None
        self.page_size = paged.page_size if paged is not None else None
        if kv_pages is not None and (isinstance(kv_pages, bool) or not isinstance(kv_pages, int) or kv_pages < 1):
            raise ValueError(f"kv_pages must be an integer >= 1, found {kv_pages!r}")
        if kv_pages is not None and paged is None:
            raise InputError(f"kv_pages needs a paged cache: an artifact with the paged functions (export --page-size) and chunked prefill; {model.directory} has none, or paged=False")
        if paged is not None:
            self.kv_pages = kv_pages or batch_size * paged.max_pages
            self._cache = model.new_pool(self.kv_pages + 1)  # + the scratch page
            self.chunk_tokens = chunk_tokens
            self._scheduler = PagedScheduler(
                batch_size, max_queue=max_queue, chunk_tokens=chunk_tokens, pool=PagePool(self.kv_pages, paged.page_size), max_seq_len=self.max_seq_len,
                decode_sizes=tuple(b for b in sizes if model.find("decode_paged", b)),
            )
        else:
            self.kv_pages = 0
            self._cache = model.new_cache(batch_size)
            self.chunk_tokens = chunk_tokens if model.find("prefill_chunk", batch_size) is not None else None
            self._scheduler = Scheduler(
                batch_size, max_queue=max_queue, batched_prefill=model.find("prefill_rows", batch_size) is not None,
                chunk_tokens=self.chunk_tokens, max_seq_len=self.max_seq_len,
            )
        self._samplers: dict[int, Sampler] = {}  # request id -> its sampler, from its prefill to its last event
        self._lock = threading.Lock()  # guards _scheduler and _stopped
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
        not finished get a last event with finish reason ``ERROR`` (kind ``STOPPED``)."""
        with self._lock:
            self._stopped = True
        self._stopping.set()
        self._wake.set()
        if self._thread is None:
            self._fail_all(EngineError(ErrorKind.STOPPED, _STOPPED))  # never started: no thread to do it
        elif self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)

    @property
    def running(self) -> bool:
        """Whether the step loop is running."""
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """How many requests wait and how many rows are in use, now (thread-safe)."""
        with self._lock:
            s = self._scheduler
            if not isinstance(s, PagedScheduler):
                return EngineStats(s.waiting, s.running, self.batch_size)
            pool = s.pool.stats()
            return EngineStats(
                s.waiting, s.running, self.batch_size, kv_pages=self.kv_pages, kv_pages_used=s.pool.used,
                kv_pages_cached=s.pool.cached_unreferenced, kv_pages_free=s.pool.free, prefix_cache_hit_tokens=pool["hits"],
                preemptions=s.preemptions,
            )

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
            request = Request(next(self._ids), list(prompt), params, on_event, self._wake)
            need = self._scheduler.pages_needed(request) if isinstance(self._scheduler, PagedScheduler) else 0
            if need > self.kv_pages:
                raise InputError(
                    f"a prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} needs {need} KV-cache pages of "
                    f"{self.page_size} positions; the pool has {self.kv_pages} (serve --kv-cache-gib)"
                )
            self._scheduler.add(request)
        self._wake.set()
        return request

    # --- the loop: decide, execute, update ------------------------------------------------------
    def _loop(self) -> None:
        why = EngineError(ErrorKind.STOPPED, _STOPPED)
        try:
            while not self._stopping.is_set():
                with self._lock:
                    plan = self._scheduler.schedule()
                self._deliver_all(plan.finished)
                if not plan.runs_model:
                    self.model.idle()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                # Prefill results are applied and delivered before the decode step runs, so a new
                # request's first token does not wait for the other rows' step.
                for results in (self._execute_prefills(plan), self._execute_decode(plan)):
                    if results.tokens or results.errors:
                        with self._lock:
                            events = self._scheduler.update(results)
                        self._deliver_all(events)
        except ModelLost as e:  # the model takes no more calls: every request ends with why
            self.failure = f"the model was lost: {e}"
            why = EngineError(ErrorKind.MODEL_LOST, self.failure)
        finally:  # stopped, or a bug ended the loop: no request may wait for it
            with self._lock:
                self._stopped = True
            self._fail_all(why)

    def _execute_prefills(self, plan: StepPlan) -> StepResults:
        """Run the plan's prefill calls; ModelLost propagates, any other failure fails the
        requests of the call that raised."""
        tokens: dict[int, int] = {}
        errors: dict[int, EngineError] = {}
        for call in plan.prefills:
            self._prefill(call, tokens, errors)
        return StepResults(tokens, errors)

    def _execute_decode(self, plan: StepPlan) -> StepResults:
        """Run the plan's decode step (rows admitted this step are not in it)."""
        tokens: dict[int, int] = {}
        errors: dict[int, EngineError] = {}
        if plan.decode is not None:
            self._decode(plan.decode, tokens, errors)
        return StepResults(tokens, errors)

    def _prefill(self, call: PrefillCall, tokens: dict[int, int], errors: dict[int, EngineError]) -> None:
        try:
            if self.chunk_tokens is not None:  # chunked mode: one chunk a call
                (p,) = call.rows
                if self.page_size is not None:
                    out, self._cache = self.model.prefill_paged(p.sequence, p.start, p.end, list(p.pages), self._cache, logits="last")
                else:
                    out, self._cache = self.model.prefill_chunk(p.request.prompt, p.start, p.end, p.row, self._cache, logits="last")
                logits = [out]
                if not p.last:
                    return
            elif len(call.rows) == 1:  # the scheduler's choice (prefill_calls): one row computed alone
                (p,) = call.rows
                out, self._cache = self.model.prefill_row(torch.tensor([list(p.tokens)], dtype=torch.int64), p.row, self._cache, logits="last")
                logits = [out[0]]
            else:
                logits, self._cache = self.model.prefill_rows([p.tokens for p in call.rows], [p.row for p in call.rows], self._cache, logits="last")
        except ModelLost:
            raise
        except Exception as e:  # these requests fail; the scheduler frees their rows
            for p in call.rows:
                errors[p.request.id] = EngineError.of(ErrorKind.PREFILL, "prefill", e)
            return
        for p, out in zip(call.rows, logits):
            try:
                sampler = Sampler(p.request.params)
                tokens[p.request.id] = sampler.next_token(out[-1])
                self._samplers[p.request.id] = sampler
            except Exception as e:
                errors[p.request.id] = EngineError.of(ErrorKind.PREFILL, "prefill", e)

    def _decode(self, batch: DecodeBatch, tokens: dict[int, int], errors: dict[int, EngineError]) -> None:
        try:
            if self.page_size is not None:
                logits, self._cache = self.model.decode_paged(list(batch.tokens), list(batch.positions), [list(t) for t in batch.tables], self._cache)
            else:
                logits, self._cache = self.model.decode(
                    torch.tensor(batch.tokens, dtype=torch.int64), self._cache, torch.tensor(batch.positions, dtype=torch.int64)
                )
        except ModelLost:
            raise
        except Exception as e:  # every row took part: they all fail
            for request, _ in batch.requests:
                errors[request.id] = EngineError.of(ErrorKind.DECODE, "decode", e)
            return
        for request, r in batch.requests:
            try:
                tokens[request.id] = self._samplers[request.id].next_token(logits[r, -1])
            except Exception as e:
                errors[request.id] = EngineError.of(ErrorKind.SAMPLING, "sampling", e)

    # --- delivery ------------------------------------------------------------------------------
    def _deliver_all(self, events) -> None:
        """Deliver ``(request, event)`` pairs; a request whose callback failed leaves the scheduler."""
        failed = [request for request, event in events if not self._deliver(request, event) and event.finish_reason is None]
        if failed:
            with self._lock:
                for request in failed:
                    self._scheduler.drop(request)

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
                    request.on_event(Event(None, FinishReason.ERROR, EngineError(ErrorKind.CALLBACK, f"on_event raised {type(e).__name__}: {e}")))
                except Exception:
                    pass
            return False
        finally:
            if request.done:
                self._samplers.pop(request.id, None)

    def _fail_all(self, why: EngineError) -> None:
        with self._lock:
            ended = self._scheduler.drain(why)
        self._deliver_all(ended)
