"""Weights known by name, shape and dtype before their bytes are read.

A :class:`WeightSource` holds a :class:`Theta` of *placeholders*: tensors of the right shape
and dtype whose memory is allocated but never touched (the OS gives them no pages), so a
model built on them and traced for export costs no weight memory. The bytes are read one
source tensor at a time, when an exporter writes them out: ``read(name)``. A shard of a
placeholder (a split piece, a replica) is recognised by the storage it views
(:meth:`WeightSource.locate`) and cut from the read tensor the same way (:meth:`view_of`).

``WeightSource.of(theta)`` wraps weights already in memory: there the placeholders are
the tensors themselves and reading returns them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from ..types import LAYOUTS, QuantizedTensor, stored
from .theta import Theta

__all__ = ["WeightSource"]

# (shape, dtype) of a plain tensor, or (shape, dtype, layout name) of a quantized one (its
# dtype: what it dequantizes to).
Spec = tuple


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype, layout: str | None = None):
    # torch.empty maps memory without writing it: no page is resident until touched.
    if layout is None:
        return torch.empty(shape, dtype=dtype)
    lay = LAYOUTS[layout]
    blocks = torch.empty((*shape[:-1], shape[-1] // lay.block_size, lay.block_bytes), dtype=torch.uint8)
    return QuantizedTensor(lay, shape, blocks, dtype=dtype)



class WeightSource:
    """Placeholder weights (``.theta``) and the function that reads each one's bytes."""

    def __init__(
        self,
        specs: Mapping[str, Spec],
        read: Callable[[str], torch.Tensor],
        *,
        spans: Mapping[str, tuple[str, int]] | None = None,
        deferred: bool = True,
        label: str = "",
    ):
        """``specs``: name -> (shape, dtype) in model order; ``read(name)``: the tensor, a fresh
        in-memory copy of that shape and dtype. ``spans``: name -> (file, byte offset) for the
        tensors a file holds exactly as ``read`` returns them (same dtype, row-major), which a
        writer may copy from the file without reading them into memory."""
        self.deferred = deferred
        self.label = label
        self.reads = 0  # tensors read into memory (tests count them)
        self._read = read
        self._spans = dict(spans or {})
        self.theta = Theta({n: _placeholder(tuple(spec[0]), *spec[1:]) for n, spec in specs.items()})
        self._index()

    @classmethod
    def of(cls, theta: Theta, label: str = "") -> "WeightSource":
        """Weights already in memory (plain tensors): the placeholders are the tensors."""
        src = cls.__new__(cls)
        src.deferred, src.label, src.reads, src._spans = False, label, 0, {}
        src.theta = theta
        src._read = lambda name: theta[name]
        src._index()
        return src

    def _index(self) -> None:
        self._by_storage: dict[int, str] = {}
        for name, t in self.theta.items():
            if isinstance(t, (torch.Tensor, QuantizedTensor)) and stored(t).numel():
                self._by_storage.setdefault(stored(t).untyped_storage().data_ptr(), name)

    def to(self, dtype: torch.dtype) -> "WeightSource":
        """The same weights with floating-point tensors converted to ``dtype`` (when read)."""

        def floating(t) -> bool:
            return isinstance(t, QuantizedTensor) or t.is_floating_point()

        def convert(t):
            # A quantized tensor keeps its blocks and dequantizes to dtype.
            return t.to(dtype) if floating(t) else t

        if not self.deferred:
            return WeightSource.of(self.theta.map(lambda _, t: convert(t)), self.label)
        specs = {
            n: (tuple(t.shape), dtype if floating(t) else t.dtype, *((t.layout.name,) if isinstance(t, QuantizedTensor) else ()))
            for n, t in self.theta.items()
        }
        # Stored bytes are unchanged where the dtype is (and for quantized blocks, always).
        spans = {n: span for n, span in self._spans.items() if isinstance(self.theta[n], QuantizedTensor) or specs[n][1] == self.theta[n].dtype}
        read = self._read
        return WeightSource(specs, lambda name: convert(read(name)), spans=spans, label=self.label)

    def names(self) -> Iterable[str]:
        return self.theta.keys()

    def read(self, name: str) -> torch.Tensor:
        """The bytes of ``name``: a contiguous tensor of its placeholder's shape and dtype."""
        want = self.theta[name]
        self.reads += 1
        t = self._read(name)
        if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype or type(t) is not type(want):
            raise ValueError(f"{self.label}: {name} read as {t!r}, declared {want!r}")
        return t.with_blocks(t.blocks.contiguous()) if isinstance(t, QuantizedTensor) else t.contiguous()

    def file_range(self, t: torch.Tensor, name: str) -> tuple[str, int, int] | None:
        """``(file, offset, length)`` of the bytes of ``t`` (a view of the placeholder ``name``)
        in the source file, when the file holds ``name`` as read and ``t`` is one contiguous
        run of it (the whole tensor, or rows of it); else None."""
        span = self._spans.get(name)
        t, base = stored(t), stored(self.theta[name])
        if span is None or not t.is_contiguous() or not base.is_contiguous():
            return None
        path, offset = span
        return path, offset + (t.storage_offset() - base.storage_offset()) * t.element_size(), t.numel() * t.element_size()

    def locate(self, t: torch.Tensor) -> str | None:
        """The name of the weight whose storage ``t`` views (a shard of it), or None."""
        t = stored(t)
        if not isinstance(t, torch.Tensor) or not t.numel():
            return None
        return self._by_storage.get(t.untyped_storage().data_ptr())

    def view_of(self, t: torch.Tensor, name: str, data: torch.Tensor) -> torch.Tensor:
        """``t`` (a view of the placeholder ``name``) taken from ``data`` (what ``read(name)``
        returned): the same sizes, strides and offset."""
        base = self.theta[name]
        if isinstance(t, QuantizedTensor):
            return t.with_blocks(self._view(t.blocks, base.blocks, data.blocks, name))
        if isinstance(base, QuantizedTensor):  # a view of the blocks themselves
            return self._view(t, base.blocks, data.blocks, name)
        return self._view(t, base, data, name)

    def _view(self, t: torch.Tensor, base: torch.Tensor, data: torch.Tensor, name: str) -> torch.Tensor:
        if not base.is_contiguous():
            raise ValueError(f"{self.label}: placeholder {name} is not contiguous")
        offset = t.storage_offset() - base.storage_offset()
        return data.as_strided(t.shape, t.stride(), data.storage_offset() + offset)

    def __repr__(self) -> str:
        kind = "deferred" if self.deferred else "in memory"
        return f"WeightSource({self.label or '?'}, {len(self.theta)} tensors, {kind})"
