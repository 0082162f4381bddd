"""The batching policy over a paged KV cache: :class:`Scheduler`'s chunked mode, with each
request's cache in pages of one pool (:class:`~sharktank.serving.pages.PagePool`) instead of
a row of its own.

- **Rows** are decode slots only: ``batch_size`` requests decode together, each through its
  own page table; what a slot held before is not kept (the pool keeps prefixes instead).
- **Admission** (first come, first served): the oldest waiting request takes a free slot when
  the pool can hold its whole length (prompt plus ``max_tokens``), counting the full pages of
  its prompt's longest prefix already in the prefix cache, which it shares instead of
  prefilling. Otherwise it, and everyone behind it, waits for pages: a request, once
  admitted, never runs out of cache, so nothing is preempted (a request that could never fit
  is refused when submitted, by the engine).
- **Prefix caching**: a prompt's pages are registered in the pool's prefix cache as they fill,
  once the chunk that wrote them has run (at the next step's start), so a later request with
  the same prefix shares them; only prompt tokens are registered (pages written by decode
  steps are not, being computed by another function than a fresh prefill's). A shared page is
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

    def pages_needed(self, request: Request) -> int:
        """The pages ``request`` reserves when admitted (its prompt and ``max_tokens``)."""
        return self.pool.pages_for(request.prompt_tokens + request.params.max_tokens)

    def table(self, row: int) -> tuple[int, ...]:
        """Slot ``row``'s page table in device page ids (the scratch page for a free slot)."""
        run = self._rows[row]
        return tuple(p + 1 for p in run.pages.pages) if run is not None else (SCRATCH_PAGE,)

    def drain(self, error: EngineError):
        for run in self._rows:
            if run is not None:
                self.pool.close(run.pages)
        return super().drain(error)

    # --- the chunked mode's steps, over pages ------------------------------------------------------
    def _free(self, r: int, held: list[int] | None = None) -> None:
        """Slot ``r`` leaves its request: the pages its finished chunks wrote join the prefix
        cache, and its references are dropped. ``held`` given (a failed call: what it wrote is
        unknown): nothing is registered."""
        run = self._rows[r]
        if run is not None:
            if held is None:
                self.pool.commit(run.pages, run.request.prompt, run.prefilled)
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
            alloc = self.pool.open(request.prompt, record=False)
            if not self.pool.extend(alloc, request.prompt_tokens + request.params.max_tokens):
                self.pool.close(alloc)
                return  # it waits for pages, and the requests behind it wait too (first come, first served)
            self.pool.record(alloc)
            self._waiting.popleft()
            r = free[0]
            self._rows[r] = _Running(request, position=request.prompt_tokens, prefilled=alloc.cached_tokens, pages=alloc)
            self._order.append(r)

    def _schedule_chunks(self, finished, decode) -> StepPlan:
        # The chunks planned last step have run (a failed one freed its slot): register their pages.
        for run in self._rows:
            if run is not None:
                self.pool.commit(run.pages, run.request.prompt, run.prefilled)
        plan = super()._schedule_chunks(finished, decode)
        prefills = tuple(PrefillCall(tuple(replace(p, pages=self.table(p.row)) for p in call.rows)) for call in plan.prefills)
        decode = plan.decode
        if decode is not None:
            decode = self._smallest(replace(decode, tables=tuple(self.table(r) for r in range(self.batch_size))))
        return replace(plan, prefills=prefills, decode=decode)

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
