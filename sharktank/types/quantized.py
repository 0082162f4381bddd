"""Quantized tensors in GGML block layouts (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), kept as stored.

A :class:`QuantizedTensor` of logical shape ``[..., K]`` holds ``K // block_size`` blocks per
row of its last dimension, each ``block_bytes`` bytes, in a uint8 tensor of shape
``[..., K // block_size, block_bytes]`` — the bytes a GGUF file stores, unchanged.
:meth:`QuantizedTensor.dequantize` expands them with torch operations only (so a traced
program can dequantize inside a product). The layouts, per block:

- ``Q8_0`` (32 values, 34 bytes): a float16 scale ``d``, 32 int8 ``q``; ``x = d * q``.
- ``Q4_0`` (32 values, 18 bytes): ``d``, 16 bytes of 4-bit ``q`` (low nibbles are values
  0-15, high nibbles 16-31); ``x = d * (q - 8)``.
- ``Q4_K`` (256 values, 144 bytes): ``d``, ``dmin`` (float16), 12 bytes of eight 6-bit scales
  and eight 6-bit mins, 128 bytes of 4-bit ``q``; sub-block ``j`` of 32: ``x = d*sc_j*q - dmin*m_j``.
- ``Q5_K`` (256 values, 176 bytes): as Q4_K plus 32 bytes holding each value's fifth bit.
- ``Q6_K`` (256 values, 210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16
  int8 scales, ``d``; sub-block ``j`` of 16: ``x = d * sc_j * (q - 32)``.

Types know nothing of ops: this module is data and its expansion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["BlockLayout", "LAYOUTS", "QuantizedTensor", "QuantizationError", "stored"]


class QuantizationError(ValueError):
    """Blocks that do not fit their layout or shape."""


def stored(t):
    """The tensor holding ``t``'s bytes: a quantized tensor's uint8 blocks, a plain tensor itself."""
    return t.blocks if isinstance(t, QuantizedTensor) else t


def _f16(b: torch.Tensor) -> torch.Tensor:
    """float32 of little-endian float16 values stored in the last dim (2 bytes each)."""
    return b.contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2]) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = b[:, 2:18]
    nibbles = torch.cat([q & 0xF, q >> 4], dim=-1).float()
    return _f16(b[:, 0:2]) * (nibbles - 8)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed into 12 bytes (Q4_K, Q5_K): for j < 4 the low 6
    bits of bytes j and j+4; for j >= 4 a nibble of byte j+4 with the top 2 bits of byte j-4
    (scale) or of byte j (min)."""
    lo, hi = s[:, 0:4], s[:, 4:8]
    tail = s[:, 8:12]
    scales = torch.cat([lo & 63, (tail & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_apply(d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = q.shape[0]
    q = q.reshape(n, 8, 32).float()
    return (d[:, :, None] * scales[:, :, None] * q - dmin[:, :, None] * mins[:, :, None]).reshape(n, 256)


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """4-bit values of the 8 sub-blocks: each 32 bytes hold two sub-blocks, low nibbles first."""
    n = qs.shape[0]
    pairs = qs.reshape(n, 4, 1, 32)
    return torch.cat([pairs & 0xF, pairs >> 4], dim=2).reshape(n, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales_mins(b[:, 4:16])
    return _k_apply(_f16(b[:, 0:2]), _f16(b[:, 2:4]), scales, mins, _k_low_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]  # bit j of byte l: the fifth bit of value l of sub-block j
    bits = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1)  # [n, 8, 32]
    q = _k_low_nibbles(b[:, 48:176]) | (bits << 4)
    return _k_apply(_f16(b[:, 0:2]), _f16(b[:, 2:4]), scales, mins, q)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 2, 32), b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16], one per 16 values
    d = _f16(b[:, 208:210])
    # Each half of 128 values: 64 bytes of low bits (two runs of 32) and 32 of high bits. Value
    # group g (0-3, 32 values each) takes the low or high nibble of run g % 2 and bits 2g, 2g+1.
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # [n, half, group, 32]
    high = torch.cat([(qh >> (2 * g)) & 3 for g in range(4)], dim=2)
    q = (low | (high << 4)).float() - 32
    return (d[:, :, None] * scales.reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, 256)


@dataclass(frozen=True)
class BlockLayout:
    """One GGML block format: values per block, bytes per block, and the expansion of
    ``[n, block_bytes]`` uint8 blocks to ``[n, block_size]`` float32 values."""

    name: str
    block_size: int
    block_bytes: int
    expand: Callable[[torch.Tensor], torch.Tensor]

    def __repr__(self) -> str:
        return f"BlockLayout({self.name}: {self.block_size} values in {self.block_bytes} bytes)"


LAYOUTS: dict[str, BlockLayout] = {
    layout.name: layout
    for layout in (
        BlockLayout("Q8_0", 32, 34, _q8_0),
        BlockLayout("Q4_0", 32, 18, _q4_0),
        BlockLayout("Q4_K", 256, 144, _q4_k),
        BlockLayout("Q5_K", 256, 176, _q5_k),
        BlockLayout("Q6_K", 256, 210, _q6_k),
    )
}


class QuantizedTensor:
    """A tensor of logical ``shape`` stored as ``layout`` blocks along its last dimension.

    ``blocks``: uint8 ``[*shape[:-1], shape[-1] // block_size, block_bytes]`` (or the same
    bytes flat, as a file stores them). ``dtype``: what :meth:`dequantize` returns by default.
    """

    def __init__(self, layout: BlockLayout | str, shape, blocks: torch.Tensor, *, dtype: torch.dtype = torch.float32, name: str | None = None):
        if isinstance(layout, str):
            if layout not in LAYOUTS:
                raise QuantizationError(f"{name or 'tensor'}: quantization {layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
            layout = LAYOUTS[layout]
        shape = tuple(shape)  # no int(): a traced dim stays symbolic (a prompt's length)
        what = name or "tensor"
        if not shape or shape[-1] % layout.block_size:
            raise QuantizationError(f"{what}: shape {list(shape)}: the last dim must be a multiple of {layout.name}'s block size {layout.block_size}")
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
            found = blocks.dtype if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise QuantizationError(f"{what}: blocks must be a uint8 tensor, found {found}")
        want = (*shape[:-1], shape[-1] // layout.block_size, layout.block_bytes)
        count = 1
        for d in want:
            count *= d
        if blocks.numel() != count:  # exact for symbolic dims too: both sides are the same product
            raise QuantizationError(
                f"{what}: {layout.name} {list(shape)} needs {count} bytes of blocks ({want[-2]} blocks of {layout.block_bytes} per row), found {blocks.numel()}"
            )
        self.layout = layout
        self.shape = torch.Size(shape)
        self.blocks = blocks.reshape(want)
        self.dtype = dtype
        self.name = name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored (the blocks)."""
        return self.blocks.numel()

    def numel(self) -> int:
        """Values represented."""
        return self.shape.numel()

    def with_blocks(self, blocks: torch.Tensor, shape=None) -> "QuantizedTensor":
        """The same layout, dtype and name over other blocks (of ``shape``, default the same)."""
        return QuantizedTensor(self.layout, self.shape if shape is None else shape, blocks, dtype=self.dtype, name=self.name)

    def to(self, dtype: torch.dtype) -> "QuantizedTensor":
        """The same blocks, dequantizing to ``dtype`` (no data changes)."""
        return QuantizedTensor(self.layout, self.shape, self.blocks, dtype=dtype, name=self.name)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        """Rows ``start .. start+length`` along ``dim``; along the last dim only whole blocks."""
        dim = dim % self.ndim
        if dim < self.ndim - 1:
            shape = list(self.shape)
            shape[dim] = length
            return self.with_blocks(self.blocks.narrow(dim, start, length), shape)
        bs = self.layout.block_size
        if start % bs or length % bs:
            raise QuantizationError(
                f"{self.name or 'tensor'}: cannot cut {self.layout.name} {list(self.shape)} at [{start}:{start + length}] "
                f"along its last dim: blocks hold {bs} values each, and a cut must fall between blocks"
            )
        return self.with_blocks(self.blocks.narrow(dim, start // bs, length // bs), (*self.shape[:-1], length))

    def split(self, sizes, dim: int) -> tuple["QuantizedTensor", ...]:
        """Consecutive pieces of ``sizes`` along ``dim`` (whole blocks along the last dim)."""
        out, start = [], 0
        for n in sizes:
            out.append(self.narrow(dim, start, n))
            start += n
        return tuple(out)

    @staticmethod
    def cat(parts: "list[QuantizedTensor]", dim: int) -> "QuantizedTensor":
        """Pieces of one layout joined along ``dim`` (the inverse of :meth:`split`)."""
        first = parts[0]
        if any(p.layout != first.layout for p in parts):
            raise QuantizationError(f"cannot join layouts {[p.layout.name for p in parts]}")
        dim = dim % first.ndim
        blocks = torch.cat([p.blocks for p in parts], dim=dim)
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        return first.with_blocks(blocks, shape)

    def equal(self, other: "QuantizedTensor") -> bool:
        return (
            isinstance(other, QuantizedTensor) and self.layout == other.layout and self.shape == other.shape
            and self.dtype == other.dtype and bool(torch.equal(self.blocks, other.blocks))
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values, ``shape`` in ``dtype`` (default: the tensor's ``dtype``)."""
        flat = self.blocks.reshape(-1, self.layout.block_bytes)
        values = self.layout.expand(flat).reshape(self.shape)
        return values.to(dtype or self.dtype)

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"QuantizedTensor{name}({self.layout.name}, {list(self.shape)}, {self.nbytes} bytes)"
