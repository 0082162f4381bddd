"""The batching policy over a paged KV cache: :class:`Scheduler`'s chunked mode, with each
request's cache in pages of one pool (:class:`~sharktank.serving.pages.PagePool`) instead of
a row of its own.

- **Rows** are decode slots only: ``batch_size`` requests decode together, each through its
  own page table; what a slot held before is not kept (the pool keeps prefixes instead).
- **Pages as a sequence grows**: a request is admitted with pages for its prompt and its first
  decode position; each decode step first gives every decoding request the page its next
  write needs, oldest first.
- **Preemption** when the pool runs out: a step that cannot give a decoding request its page
  preempts the youngest running request (the most recently admitted, perhaps the one asking):
  its pages are released (the full pages it prefilled join the prefix cache like a finished
  request's), and it goes back to the queue ahead of every request not yet admitted, oldest
  first. Resumed, it prefills its prompt and the tokens it had fed back to decode (reusing
  whatever of them is still cached), yields no token for that prefill (it has its next token
  already: its sampler is untouched) and decodes on; its client sees a delay, never a repeated
  or lost token (the recomputed entries equal the first ones up to the rounding of a prefill
  against a decode step). The oldest running request is never preempted while another runs, and a
  request alone always fits (the engine refuses one larger than the pool), so every admitted
  request finishes.
- **Admission** (first come, first served, resumed requests first): the oldest waiting request
  takes a free slot when the pool can give it those pages, counting the full pages of its
  prompt's longest prefix already in the prefix cache (shared instead of prefilled), and still
  keep one page of growth for each running request (so admitting does not preempt at the next
  page boundary). Otherwise it, and everyone behind it, waits.
- **Prefix caching**: a prompt's pages are registered in the pool's prefix cache as they fill,
  once the chunk that wrote them has run (at the next step's start), so a later request with
  the same prefix shares them; only prefilled tokens are registered (a prompt, or a resumed
  request's prompt and fed-back tokens; pages written by decode steps are not, being computed
  by another function than a fresh prefill's). A shared page is
  full and never written again: a request's first chunk starts on a page of its own.
- **Chunks and decode** as in :class:`Scheduler`'s chunked mode; the plan carries each
  prefill's page table and each decode row's (a free slot's dummy token writes into the
  scratch page, device page 0, which no sequence owns).
- **The decode batch** is the smallest of ``decode_sizes`` (the exported ``decode_paged``
  batch sizes) that holds the decoding requests: a slot is only a page table, so the step
  runs those rows alone (padded with free slots up to that size) rather than every slot; one
  request decodes with ``decode_paged_bs1`` when it is exported.

Device page ``i + 1`` is the pool's page ``i``: device page 0 is the scratch page.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from .events import EngineError
from .pages import PagePool
from .plan import DecodeBatch, PrefillCall, StepPlan
from .request import Request
from .scheduler import Scheduler, _Running

__all__ = ["PagedScheduler", "SCRATCH_PAGE"]

SCRATCH_PAGE = 0  # the device page free slots' dummy decode writes; never in a sequence's table


class PagedScheduler(Scheduler):
    """:class:`Scheduler`'s chunked mode over ``pool``: ``batch_size`` decode slots, at most
    ``chunk_tokens`` prompt tokens prefilled a step."""

    def __init__(self, batch_size: int, *, max_queue: int, chunk_tokens: int, pool: PagePool, max_seq_len: int, decode_sizes: tuple[int, ...] = ()):
        super().__init__(batch_size, max_queue=max_queue, batched_prefill=False, chunk_tokens=chunk_tokens, max_seq_len=max_seq_len)
        self.pool = pool
        self.decode_sizes = tuple(sorted({b for b in decode_sizes if b < batch_size} | {batch_size}))
        self.preemptions = 0  # requests preempted since start
        self._resumed: dict[int, _Running] = {}  # request id -> the state of a preempted request waiting
        self._ages = itertools.count()

    def pages_needed(self, request: Request) -> int:
        """The pages ``request`` holds at its longest (its prompt and ``max_tokens``): the
        engine refuses one that needs more than the pool."""
        return self.pool.pages_for(request.prompt_tokens + request.params.max_tokens)

    def table(self, row: int) -> tuple[int, ...]:
        """Slot ``row``'s page table in device page ids (the scratch page for a free slot)."""
        run = self._rows[row]
        return tuple(p + 1 for p in run.pages.pages) if run is not None else (SCRATCH_PAGE,)

    def schedule(self) -> StepPlan:
        """Retire cancelled requests, register the pages last step's chunks wrote, give the
        decoding requests their next page (preempting the youngest when the pool runs out),
        admit waiting requests and plan the step."""
        finished = self._retire_cancelled()
        self._forget_resumed()
        for run in self._rows:  # the chunks planned last step have run (a failed one freed its slot)
            if run is not None:
                self.pool.commit(run.pages, run.sequence(), run.prefilled)
        preempted = self._grow()
        plan = self._schedule_chunks(finished, self._decode_batch())
        prefills = tuple(PrefillCall(tuple(replace(p, pages=self.table(p.row)) for p in call.rows)) for call in plan.prefills)
        decode = plan.decode
        if decode is not None:
            decode = self._smallest(replace(decode, tables=tuple(self.table(r) for r in range(self.batch_size))))
        return replace(plan, prefills=prefills, decode=decode, preempted=tuple(preempted))

    def drop(self, request: Request) -> None:
        super().drop(request)
        self._forget_resumed()

    def drain(self, error: EngineError):
        for run in self._rows:
            if run is not None:
                self.pool.close(run.pages)
        self._resumed.clear()
        return super().drain(error)

    # --- growth and preemption ---------------------------------------------------------------------
    def _grow(self) -> list[Request]:
        """Give every decoding request the pages its next write needs, oldest first, preempting
        the youngest running request while the pool cannot; returns the preempted requests."""
        preempted: list[Request] = []
        for r, run in sorted(self._decoding(), key=lambda item: item[1].age):
            while self._rows[r] is run and not self.pool.extend(run.pages, run.position + 1):
                victim = max((i for i, q in enumerate(self._rows) if q is not None), key=lambda i: self._rows[i].age)
                preempted.append(self._rows[victim].request)
                self._preempt(victim)
        return preempted

    def _preempt(self, r: int) -> None:
        """Slot ``r``'s request goes back to the queue, ahead of every request never admitted
        and behind older preempted ones, with what it must prefill again when resumed."""
        run = self._rows[r]
        self._free(r)  # its prefilled full pages join the prefix cache
        run.resumed = run.request.prompt + run.outputs[:-1] if run.outputs else None
        run.prefilled, run.pages = 0, None
        self._resumed[run.request.id] = run
        at = sum(1 for q in self._waiting if q.id in self._resumed and self._resumed[q.id].age < run.age)
        self._waiting.insert(at, run.request)
        self.preemptions += 1

    def _forget_resumed(self) -> None:
        """Drop the saved state of preempted requests no longer waiting (cancelled, dropped)."""
        waiting = {q.id for q in self._waiting}
        for rid in [rid for rid in self._resumed if rid not in waiting]:
            del self._resumed[rid]

    # --- the chunked mode's steps, over pages ------------------------------------------------------
    def _free(self, r: int, held: list[int] | None = None) -> None:
        """Slot ``r`` leaves its request: the pages its finished chunks wrote join the prefix
        cache, and its references are dropped. ``held`` given (a failed call: what it wrote is
        unknown): nothing is registered."""
        run = self._rows[r]
        if run is not None:
            if held is None:
                self.pool.commit(run.pages, run.sequence(), run.prefilled)
            self.pool.close(run.pages)
        super()._free(r, held=[])

    def _dummy_position(self, r: int) -> int:
        """A prefilling slot's dummy write goes to its next chunk's start (its own page, which
        that chunk overwrites); a free slot's to position 0 of the scratch page."""
        run = self._rows[r]
        return run.prefilled if run is not None else 0

    def _admit_reusing(self) -> None:
        while self._waiting:
            free = [r for r in range(self.batch_size) if self._rows[r] is None]
            if not free:
                return
            request = self._waiting[0]
            run = self._resumed.get(request.id)
            sequence = run.sequence() if run is not None else request.prompt
            alloc = self.pool.open(sequence, record=False)
            need = self.pool.pages_for(len(sequence) + 1) - len(alloc.pages)  # + its first decode write
            if need + self.running > self.pool.available or not self.pool.extend(alloc, len(sequence) + 1):
                self.pool.close(alloc)
                return  # it waits for pages, and the requests behind it wait too (first come, first served)
            self.pool.record(alloc)
            self._waiting.popleft()
            if run is None:
                run = _Running(request, position=request.prompt_tokens, age=next(self._ages))
            else:
                del self._resumed[request.id]
            run.prefilled, run.pages = alloc.cached_tokens, alloc
            r = free[0]
            self._rows[r] = run
            self._order.append(r)

    def _smallest(self, decode: DecodeBatch) -> DecodeBatch:
        """``decode`` (over every slot) as the smallest decode batch that holds its requests:
        their slots first, then other slots as padding; ``requests`` then name indexes of
        that batch."""
        live = [r for _, r in decode.requests]
        size = next(b for b in self.decode_sizes if b >= len(live))
        if size == self.batch_size:
            return decode
        # Padding: free slots first, then slots still prefilling (whose dummy token, as in the
        # whole batch, goes where their next real write lands before anything reads it).
        rest = sorted((r for r in range(self.batch_size) if r not in set(live)), key=lambda r: self._rows[r] is not None)
        order = live + rest[: size - len(live)]
        at = {r: i for i, r in enumerate(order)}
        return DecodeBatch(
            tuple(decode.tokens[r] for r in order), tuple(decode.positions[r] for r in order),
            tuple((request, at[r]) for request, r in decode.requests), tuple(decode.tables[r] for r in order),
        )
