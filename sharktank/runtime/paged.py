"""Calls of an artifact's paged functions (``export --page-size``): a pool of KV-cache pages
on the devices and the two calls that read and write it through page tables.

The pool holds ``P`` pages of ``page_size`` positions per block (``P`` chosen here, at
allocation: the exported functions take any). A sequence's position ``p`` lives in page
``pages[p // page_size]`` of its table, slot ``p % page_size``; which pages a sequence owns
is the caller's bookkeeping (``sharktank.serving.pages``). Page ids are checked here: the
module does not bound-check them, and an id past the pool would read or write outside it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..export.manifest import FunctionSpec
from .inputs import InputError, check_chunk, int_list, kept_logits, last_positions

__all__ = ["PagedCalls"]


class PagedCalls:
    """``new_pool``, ``prefill_paged`` and ``decode_paged`` of a :class:`CompiledModel` whose
    artifact has the paged functions (``page_size`` is None otherwise)."""

    @property
    def page_size(self) -> int | None:
        spec = self.find("prefill_paged", 1)
        return spec.page_size if spec is not None else None

    @property
    def max_pages(self) -> int:
        """Page-table entries of one sequence: ``ceil(max_seq_len / page_size)``."""
        return self._paged_spec("prefill_paged", 1).max_pages

    def page_bytes(self) -> dict[int, int]:
        """Bytes one pool page takes on each device (its blocks' keys and values there)."""
        spec = self._paged_spec("prefill_paged", 1)
        out: dict[int, int] = {}
        for a in spec.cache_args:
            out[a.device] = out.get(a.device, 0) + int(np.prod(a.shape[1:])) * getattr(torch, a.dtype).itemsize
        return out

    def pages_in(self, gib: float) -> int:
        """The pool pages that fit in ``gib`` GiB on every device (the busiest device decides)."""
        if not gib > 0:
            raise InputError(f"the KV-cache size must be > 0 GiB, found {gib!r}")
        per_device = max(self.page_bytes().values())
        pages = int(gib * 2**30 // per_device)
        if pages < 2:
            raise InputError(f"{gib} GiB holds {pages} KV-cache pages of {per_device} bytes on the busiest device; at least 2 are needed")
        return pages

    def _paged_spec(self, kind: str, batch: int) -> FunctionSpec:
        spec = self.find(kind, batch)
        if spec is None:
            have = "" if self.find("prefill_paged", 1) is not None else " (export with --page-size to have them)"
            raise InputError(f"no {kind} function for batch size {batch}{have}")
        return spec

    def new_pool(self, num_pages: int) -> list:
        """A zeroed pool of ``num_pages`` pages per block on the devices (the cache arrays of
        the paged functions)."""
        spec = self._paged_spec("prefill_paged", 1)
        if not isinstance(num_pages, int) or num_pages < 2:
            raise InputError(f"a pool needs at least 2 pages, found {num_pages!r}")
        return [self.zeros((num_pages, *a.shape[1:]), a) for a in spec.cache_args]

    def _pool_pages(self, spec: FunctionSpec, pool) -> int:
        shapes = [tuple(a.shape) for a in pool] if isinstance(pool, (list, tuple)) and all(hasattr(a, "shape") for a in pool) else None
        want = [a.shape[1:] for a in spec.cache_args]
        if shapes is None or [s[1:] for s in shapes] != want or len({s[0] for s in shapes}) != 1:
            raise InputError(f"{spec.name} takes a pool from new_pool ({len(want)} arrays of [P, {', '.join(map(str, want[0]))}]), found {shapes!r:.200}")
        return shapes[0][0]

    def _invoke_paged(self, spec: FunctionSpec, tokens, positions, pages, pool, keep=None) -> tuple[torch.Tensor, list]:
        import time

        devices = [a.device for a in spec.args]
        t0 = time.perf_counter()
        indices = (tokens, positions, pages) + (((keep or [list(range(len(tokens[0])))]),) if spec.takes_keep else ())
        inputs = [self.session.place(np.asarray(v, np.int64), devices[i]) for i, v in enumerate(indices)]
        out = self.session.invoke(spec.name, [*inputs, *pool])
        logits = self._to_torch(out[0])
        if keep is not None and not spec.takes_keep:  # exported before `keep` existed: every position came back
            logits = kept_logits(logits, keep)
        self.timings.setdefault(spec.kind, []).append(time.perf_counter() - t0)
        return logits, list(out[1:])

    def _check_table(self, table: list[int], count: int, need: int, size: int, what: str) -> None:
        if any(not 0 <= p < count for p in table):
            raise InputError(f"{what}: page ids must be in [0, {count}) for a pool of {count} pages, found {table}")
        if len(table) * size < need:
            raise InputError(f"{what}: {len(table)} pages of {size} hold positions below {len(table) * size}, but position {need - 1} is needed")
        if len(table) > self.max_pages:
            raise InputError(f"{what}: at most {self.max_pages} pages a sequence (max_seq_len {self._paged_spec('prefill_paged', 1).max_seq_len}), found {len(table)}")

    def prefill_paged(
        self, prompt: Sequence[int], start: int, end: int, pages: Sequence[int], pool: list, *, logits: str = "all"
    ) -> tuple[torch.Tensor, list]:
        """``(logits [end - start, vocab], pool)``: ``prompt[start:end]`` written at positions
        ``start .. end - 1`` of the sequence whose page table is ``pages``, attending over its
        positions ``0 .. end - 1`` (those before ``start`` must already hold ``prompt[:start]``:
        an earlier chunk, or cached pages of the same tokens). Only the pages the chunk's
        positions fall in are written. A one-token chunk runs with a dummy token after it, so
        ``pages`` must then also cover position ``end`` (which the sequence's next write, its
        first decode step, replaces before anything reads it). ``logits="last"``: the chunk's
        last position's, ``[1, vocab]`` (:meth:`~sharktank.runtime.compiled.PrefillDecode.prefill`)."""
        keep = last_positions(logits, [end - start - 1])
        spec = self._paged_spec("prefill_paged", 1)
        check_chunk(prompt, start, end)
        prompt, table = list(prompt), int_list(pages, "pages")
        count = self._pool_pages(spec, pool)
        ids = prompt[start:end] + ([0] if end - start == 1 else [])
        self._check_table(table, count, start + len(ids), spec.page_size, "prefill_paged")
        if int(min(ids)) < 0 or int(max(ids)) >= self.vocab_size:
            raise InputError(f"token ids must be in [0, {self.vocab_size}), found {min(ids)}..{max(ids)}")
        used = max(-(-(start + len(ids)) // spec.page_size), 2)  # the exported table is at least 2 pages
        window = (table + [table[0]] * 2)[:used]
        out, pool = self._invoke_paged(spec, [ids], [list(range(start, start + len(ids)))], [window], pool, keep)
        return (out[0] if keep else out[0, : end - start]), pool

    def decode_paged(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]], pool: list) -> tuple[torch.Tensor, list]:
        """``(logits [B, 1, vocab], pool)``: token ``tokens[b]`` at position ``positions[b]`` of
        the sequence whose page table is ``tables[b]``, one row each (``B`` an exported batch
        size). A row not in use can point at any page it may write: its token's entry goes to
        ``positions[b]`` through its table."""
        tokens, positions = int_list(tokens, "tokens"), int_list(positions, "positions")
        if len(tokens) != len(positions) or len(tables) != len(tokens):
            raise InputError(f"decode_paged takes one token, position and page table per row, found {len(tokens)}, {len(positions)} and {len(tables)}")
        spec = self._paged_spec("decode_paged", len(tokens))
        count = self._pool_pages(spec, pool)
        rows = []
        for b, (pos, table) in enumerate(zip(positions, tables)):
            table = int_list(table, f"tables[{b}]")
            if pos < 0:
                raise InputError(f"positions must be >= 0, found {pos}")
            self._check_table(table, count, pos + 1, spec.page_size, f"decode_paged row {b}")
            rows.append(table + [table[0]] * (spec.max_pages - len(table)))
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise InputError(f"token ids must be in [0, {self.vocab_size}), found {min(tokens)}..{max(tokens)}")
        return self._invoke_paged(spec, [[t] for t in tokens], [[p] for p in positions], rows, pool)
