"""Quantized tensors in GGML block layouts, kept as stored.

A :class:`QuantizedTensor` of logical shape ``[..., K]`` holds ``K // block_size`` blocks per
row of its last dimension, each ``block_bytes`` bytes, in a uint8 tensor of shape
``[..., K // block_size, block_bytes]`` — the bytes a GGUF file stores, unchanged.
:meth:`QuantizedTensor.dequantize` expands them with torch operations only (so a traced
program can dequantize inside a product). The layouts, per block:

- ``Q8_0`` (32 values, 34 bytes): a float16 scale ``d``, 32 int8 ``q``; ``x = d * q``.
- ``Q4_0`` (32 values, 18 bytes): ``d``, 16 bytes of 4-bit ``q`` (low nibbles are values
  0-15, high nibbles 16-31); ``x = d * (q - 8)``.
- ``Q4_1`` (32 values, 20 bytes): ``d``, ``m`` (float16), 16 bytes of 4-bit ``q``; ``x = d * q + m``.
- ``Q5_0`` (32 values, 22 bytes): ``d``, 4 bytes holding each value's fifth bit (bit ``i`` of the
  little-endian word for value ``i``), 16 bytes of low 4 bits as Q4_0; ``x = d * (q - 16)``.
- ``Q5_1`` (32 values, 24 bytes): ``d``, ``m``, the fifth bits, the low 4 bits; ``x = d * q + m``.
- ``IQ4_NL`` (32 values, 18 bytes): as Q4_0, but each nibble indexes a fixed table of 16 int8
  levels; ``x = d * level[q]``.
- ``Q2_K`` (256 values, 84 bytes): 16 bytes of 4-bit scale / 4-bit min pairs, 64 bytes of 2-bit
  ``q``, ``d``, ``dmin``; sub-block ``j`` of 16: ``x = d*sc_j*q - dmin*m_j``.
- ``Q3_K`` (256 values, 110 bytes): 32 bytes of high bits, 64 bytes of 2-bit low bits, 12
  bytes of sixteen 6-bit scales, ``d``; sub-block ``j`` of 16: ``x = d * (sc_j - 32) * q``
  with ``q = low - 4`` where the high bit is clear, ``low`` where it is set.
- ``Q4_K`` (256 values, 144 bytes): ``d``, ``dmin`` (float16), 12 bytes of eight 6-bit scales
  and eight 6-bit mins, 128 bytes of 4-bit ``q``; sub-block ``j`` of 32: ``x = d*sc_j*q - dmin*m_j``.
- ``Q5_K`` (256 values, 176 bytes): as Q4_K plus 32 bytes holding each value's fifth bit.
- ``Q6_K`` (256 values, 210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16
  int8 scales, ``d``; sub-block ``j`` of 16: ``x = d * sc_j * (q - 32)``.
- ``IQ4_XS`` (256 values, 136 bytes): ``d``, 2 bytes of high and 4 bytes of low scale bits
  (eight 6-bit scales), 128 bytes of nibbles as IQ4_NL's; sub-block ``j`` of 32:
  ``x = d * (sc_j - 32) * level[q]``.

Types know nothing of ops: this module is data and its expansion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .placement import split_sizes

__all__ = ["BlockLayout", "LAYOUTS", "QuantizedTensor", "QuantizationError", "stored"]


class QuantizationError(ValueError):
    """Blocks that do not fit their layout or shape."""


def stored(t):
    """The tensor holding ``t``'s bytes: a quantized tensor's uint8 blocks, a plain tensor itself."""
    return t.blocks if isinstance(t, QuantizedTensor) else t


def _f16(b: torch.Tensor) -> torch.Tensor:
    """float32 of the little-endian float16 held in the last dim's 2 bytes (that dim dropped).

    Built as ``lo | hi << 8`` and reinterpreted: elementwise on the block bytes, so a compiler
    fuses it into the product, where a contiguous copy of the 2-byte slice would be a strided
    copy of every block (it reads the whole weight) on each call."""
    bits = b[..., 0].to(torch.int16) | (b[..., 1].to(torch.int16) << 8)
    return bits.view(torch.float16).float()


def _shifts(count: int, step: int, shape) -> torch.Tensor:
    """Shift amounts ``0, step, .., (count-1)*step`` in ``shape``, broadcast against the blocks.
    int32, as are the bytes they shift (:func:`_shift`): torch-mlir lowers neither a uint8
    arange nor ``>>`` of two tensors."""
    return torch.arange(0, count * step, step, dtype=torch.int32).reshape(shape)


def _shift(b: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Bytes ``b`` (as int32) shifted right by ``shifts``, broadcast."""
    return torch.bitwise_right_shift(b.to(torch.int32), shifts)


def _nibbles(q: torch.Tensor, at: int) -> torch.Tensor:
    """Low and high 4 bits of ``q`` in a new dim of 2 (low first) at ``at``, counted from the end."""
    return _shift(q.unsqueeze(at), _shifts(2, 4, (2, *[1] * (-at - 1)))) & 0xF


def _q8_0(b):
    return b[..., 2:34].view(torch.int8), _f16(b[..., 0:2]), None


def _q4_0(b):
    q = _nibbles(b[..., 2:18], -2) - 8  # [.., nibble 2, 16]: values 0-15, 16-31
    return q, _f16(b[..., 0:2])[..., None].expand(*b.shape[:-1], 2), None


def _q4_1(b):
    q = _nibbles(b[..., 4:20], -2)  # [.., nibble 2, 16]: values 0-15, 16-31
    lead = (*b.shape[:-1], 2)
    return q, _f16(b[..., 0:2])[..., None].expand(lead), _f16(b[..., 2:4])[..., None].expand(lead)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """The fifth bit of each of 32 values from 4 bytes, ``[.., nibble 2, 16]`` like :func:`_nibbles`:
    value ``16 * h + l`` has bit ``l % 8`` of byte ``2 * h + l // 8``."""
    bits = _shift(qh.reshape(*qh.shape[:-1], 2, 2, 1), _shifts(8, 1, (8,))) & 1
    return bits.reshape(*qh.shape[:-1], 2, 16)


def _q5_0(b):
    q = (_nibbles(b[..., 6:22], -2) | (_fifth_bits(b[..., 2:6]) << 4)) - 16
    return q, _f16(b[..., 0:2])[..., None].expand(*b.shape[:-1], 2), None


def _q5_1(b):
    q = _nibbles(b[..., 8:24], -2) | (_fifth_bits(b[..., 4:8]) << 4)
    lead = (*b.shape[:-1], 2)
    return q, _f16(b[..., 0:2])[..., None].expand(lead), _f16(b[..., 2:4])[..., None].expand(lead)


# IQ4_NL's and IQ4_XS's 16 levels (non-uniform, denser near zero), as ggml defines them.
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_levels(nibbles: torch.Tensor) -> torch.Tensor:
    """Each nibble's level, as selects rather than a table lookup: a table made while tracing
    leaves an aten.detach_ that IREE 3.10 cannot lower, a gather by int32 indices does not
    compile, and one by int64 indices inside the one-pass product is miscompiled for AVX2
    (x86-64-v3: errors of the logits' size; right for AVX-512)."""
    out = torch.full_like(nibbles, _IQ4_LEVELS[0])
    for i, level in enumerate(_IQ4_LEVELS[1:], 1):
        out = torch.where(nibbles == i, level, out)
    return out


def _iq4_nl(b):
    q = _iq4_levels(_nibbles(b[..., 2:18], -2))
    return q, _f16(b[..., 0:2])[..., None].expand(*b.shape[:-1], 2), None


def _iq4_xs(b):
    # Sub-block j of 32: the low 4 bits of its scale are nibble j % 2 of byte 2 + j // 2 (a
    # pair of sub-blocks per byte), the high 2 bits are bits 2j, 2j+1 of the 16-bit word at 2.
    low = _nibbles(b[..., 4:8], -1).flatten(-2)  # [.., 8]: byte-major, low nibble first
    high = _shift(b[..., 2:4].reshape(*b.shape[:-1], 2, 1), _shifts(4, 2, (4,))).flatten(-2) & 3
    scales = ((low | (high << 4)) - 32).float()  # [.., 8]
    q = _iq4_levels(_nibbles(b[..., 8:136].reshape(*b.shape[:-1], 8, 16), -2))  # [.., 8, 2, 16]
    return q.flatten(-2), _f16(b[..., 0:2])[..., None] * scales, None


def _k_two_bits(qs: torch.Tensor) -> torch.Tensor:
    """The 2-bit values of Q2_K / Q3_K, ``[.., half 2, shift 4, run 2, 16]``: each half of 128
    values reads 32 bytes four times (bits 0-1, 2-3, 4-5, 6-7), a run of 16 bytes per group."""
    return _shift(qs.reshape(*qs.shape[:-1], 2, 1, 2, 16), _shifts(4, 2, (4, 1, 1))) & 3


def _q2_k(b):
    sc = b[..., 0:16].reshape(*b.shape[:-1], 2, 4, 2).to(torch.int32)  # group order: half, shift, run
    d, dmin = _f16(b[..., 80:82])[..., None, None, None], _f16(b[..., 82:84])[..., None, None, None]
    return _k_two_bits(b[..., 16:80]), d * (sc & 0xF).float(), -(dmin * (sc >> 4).float())


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Sixteen 6-bit scales from 12 bytes, ``[.., 16]``: scale ``i``'s low 4 bits are nibble
    ``i // 8`` of byte ``i % 8``, its high 2 bits are bits ``2 * (i // 4)`` of byte ``8 + i % 4``."""
    low = _shift(s[..., None, 0:8], _shifts(2, 4, (2, 1))) & 0xF  # [.., 2, 8]
    high = _shift(s[..., None, None, 8:12], _shifts(4, 2, (2, 2, 1))) & 3  # [.., 2, 2, 4]
    return (low.reshape(high.shape) | (high << 4)).flatten(-3) - 32


def _q3_k(b):
    lead = b.shape[:-1]
    high = _shift(b[..., None, None, 0:32].reshape(*lead, 1, 1, 2, 16), _shifts(8, 1, (2, 4, 1, 1))) & 1
    q = _k_two_bits(b[..., 32:96]) + 4 * high - 4  # the high bit set: no 4 taken off
    scales = _q3_k_scales(b[..., 96:108]).reshape(*lead, 2, 4, 2).float()
    return q, _f16(b[..., 108:110])[..., None, None, None] * scales, None


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed into 12 bytes (Q4_K, Q5_K), ``[.., 4, 2]`` (sub-block
    ``j = 2 * pair + nibble``): for j < 4 the low 6 bits of bytes j and j+4; for j >= 4 a nibble
    of byte j+4 with the top 2 bits of byte j-4 (scale) or of byte j (min)."""
    lo, hi, tail = s[..., None, 0:4], s[..., None, 4:8], s[..., None, 8:12]
    first = torch.arange(2).reshape(2, 1) == 0  # [half 2, 1]: sub-blocks 0-3, then 4-7
    scales = torch.where(first, lo & 63, (tail & 0xF) | ((lo >> 6) << 4))
    mins = torch.where(first, hi & 63, (tail >> 4) | ((hi >> 6) << 4))
    shape = (*s.shape[:-1], 4, 2)
    return scales.reshape(shape).float(), mins.reshape(shape).float()


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """4-bit values of the 8 sub-blocks ``[.., pair 4, nibble 2, 32]``: each 32 bytes hold two
    sub-blocks, low nibbles first."""
    return _nibbles(qs.reshape(*qs.shape[:-1], 4, 32), -2)


def _k_affine(b, q):
    scales, mins = _k_scales_mins(b[..., 4:16])
    d, dmin = _f16(b[..., 0:2])[..., None, None], _f16(b[..., 2:4])[..., None, None]
    return q, d * scales, -(dmin * mins)


def _q4_k(b):
    return _k_affine(b, _k_low(b[..., 16:144]))


def _q5_k(b):
    qh = b[..., None, None, 16:48]  # bit j of byte l: the fifth bit of value l of sub-block j
    fifth = _shift(qh, _shifts(8, 1, (4, 2, 1))) & 1
    return _k_affine(b, _k_low(b[..., 48:176]) | (fifth << 4))


def _q6_k(b):
    lead = b.shape[:-1]
    # Each half of 128 values: 64 bytes of low bits (two runs of 32) and 32 of high bits. Value
    # group g = 2 * nibble + run (32 values) takes that nibble of that run, and bits 2g, 2g+1.
    low = _nibbles(b[..., 0:128].reshape(*lead, 2, 2, 32), -3)  # [.., half, nibble, run, 32]
    high = _shift(b[..., 128:192].reshape(*lead, 2, 1, 1, 32), _shifts(4, 2, (2, 2, 1))) & 3
    q = ((low | (high << 4)) - 32).reshape(*lead, 2, 2, 2, 2, 16)
    scales = b[..., 192:208].view(torch.int8).float().reshape(*lead, 2, 2, 2, 2)  # one per 16 values
    return q, _f16(b[..., 208:210])[..., None, None, None, None] * scales, None


@dataclass(frozen=True)
class BlockLayout:
    """One GGML block format: values per block, bytes per block, and its affine form.

    ``affine(blocks)`` takes uint8 blocks ``[..., block_bytes]`` and gives ``(q, scale,
    offset)``: integer values ``q`` ``[..., *groups, inner]``, and float32 ``scale`` and
    ``offset`` (or None) ``[..., *groups]``, one per group of ``inner`` values, such that
    the block's values, in order, are ``scale * q + offset`` flattened. Everything is
    elementwise on the block bytes (no joins), so a compiler can fuse it into a product
    (:meth:`QuantizedTensor.product`) and never materialise the values.
    """

    name: str
    block_size: int
    block_bytes: int
    affine: Callable[[torch.Tensor], tuple]
    scale_per_block: bool = False  # one float16 scale per block, no sub-block scales

    def grouped_values(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[..., block_bytes]`` blocks to their float32 values ``scale * q + offset``, in the
        affine form's ``[..., *groups, inner]`` shape."""
        q, scale, offset = self.affine(blocks)
        values = scale[..., None] * q.float()
        return values if offset is None else values + offset[..., None]

    def expand(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[..., block_bytes]`` blocks to their ``[..., block_size]`` float32 values."""
        return self.grouped_values(blocks).reshape(*blocks.shape[:-1], self.block_size)

    def __repr__(self) -> str:
        return f"BlockLayout({self.name}: {self.block_size} values in {self.block_bytes} bytes)"


LAYOUTS: dict[str, BlockLayout] = {
    layout.name: layout
    for layout in (
        BlockLayout("Q8_0", 32, 34, _q8_0, scale_per_block=True),
        BlockLayout("Q4_0", 32, 18, _q4_0, scale_per_block=True),
        BlockLayout("Q4_1", 32, 20, _q4_1, scale_per_block=True),
        BlockLayout("Q5_0", 32, 22, _q5_0, scale_per_block=True),
        BlockLayout("Q5_1", 32, 24, _q5_1, scale_per_block=True),
        BlockLayout("IQ4_NL", 32, 18, _iq4_nl, scale_per_block=True),
        BlockLayout("Q2_K", 256, 84, _q2_k),
        BlockLayout("Q3_K", 256, 110, _q3_k),
        BlockLayout("Q4_K", 256, 144, _q4_k),
        BlockLayout("Q5_K", 256, 176, _q5_k),
        BlockLayout("Q6_K", 256, 210, _q6_k),
        BlockLayout("IQ4_XS", 256, 136, _iq4_xs),
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

    def split_sizes(self, dim: int, count: int, name: str | None = None) -> list[int]:
        """Sizes of ``count`` consecutive pieces along ``dim``: ``torch.tensor_split`` sizes of
        the rows along a leading dim; along the last dim, of the blocks (the first ``blocks %
        count`` pieces one block larger), so every cut falls between blocks. Refused when a row
        holds fewer blocks than pieces (``name`` names the tensor in the refusal)."""
        dim = dim % self.ndim
        if dim < self.ndim - 1:
            return split_sizes(self.shape[dim], count)
        bs, blocks = self.layout.block_size, self.shape[-1] // self.layout.block_size
        if blocks < count:
            raise QuantizationError(
                f"{name or self.name or 'tensor'}: cannot split {self.layout.name} {list(self.shape)} into {count} shards "
                f"along its last dim: its rows hold {blocks} blocks (blocks hold {bs} values each), "
                f"fewer than the shards, and each shard takes whole blocks"
            )
        return [bs * n for n in split_sizes(blocks, count)]

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

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ self.dequantize().T`` for a 2-D ``[N, K]`` tensor and ``x`` ``[..., K]``, written
        on the blocks, for a compiler to fuse the expansion into the reduction and read only
        the blocks. Eagerly it costs the values' memory for every row of ``x`` (use it for
        few rows). Computed in float32; the result has ``x``'s dtype.

        Layouts whose scale is the block's own (``scale_per_block``: Q8_0, Q4_x, Q5_x, IQ4_NL) form every
        value and reduce a row in one pass. K-quants, whose 6-bit sub-block scales are unpacked
        from shared bytes, first sum ``x * q`` per group of values, then scale the groups'
        sums (and add each offset times the sum of ``x``'s group): unpacking the scales per
        value inside one pass is ~50x slower in IREE 3.10's CPU code.
        """
        if self.ndim != 2 or x.shape[-1] != self.shape[1]:
            raise QuantizationError(f"{self.name or 'tensor'}: product of x {list(x.shape)} with a quantized [N, K] {list(self.shape)}: x's last dim must be K")
        if self.layout.scale_per_block:
            values = self.layout.grouped_values(self.blocks)  # [N, blocks, *groups, inner]
            xs = x.reshape(-1, 1, *values.shape[1:]).float()  # [rows, 1, blocks, *groups, inner]
            y = (xs * values[None]).sum(tuple(range(2, xs.ndim)))
        else:
            q, scale, offset = self.layout.affine(self.blocks)
            xs = x.reshape(-1, 1, *q.shape[1:]).float()
            terms = (xs * q.float()[None]).sum(-1) * scale[None]  # [rows, N, blocks, *groups]
            if offset is not None:
                terms = terms + xs.sum(-1) * offset[None]
            y = terms.flatten(2).sum(-1)
        return y.reshape(*x.shape[:-1], self.shape[0]).to(x.dtype)

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"QuantizedTensor{name}({self.layout.name}, {list(self.shape)}, {self.nbytes} bytes)"
