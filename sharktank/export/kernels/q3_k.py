"""The Q3_K block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch, with ``x``
as 16-bit integers per 32 values (:mod:`.int16_x`) and integer dot products, in the frame
Q6_K's kernel uses (16 scales of 16 values a super-block).

A 110-byte super-block of 256 values: 32 bytes of high bits (value t: bit ``t // 32`` of byte
``t % 32``), 64 bytes of 2-bit low bits (value ``128 h + 32 j + l``: bits ``2j, 2j + 1`` of byte
``32 h + l``), 12 bytes of 16 six-bit scales (scale s: low 4 bits from byte ``s % 8``, nibble
``s // 8``; high 2 bits from byte ``8 + s % 4``, bits ``2 (s // 4)``; stored + 32) and ``d``
(float16). Value t is ``d * (sc[t // 16] - 32) * (u - 4)``, ``u`` = low bits | high bit << 2,
unsigned 0..7: the kernel multiplies ``u`` exactly with x (``vpdpbusd``, 64 values a vector in
order) and takes ``4 * d * sc`` times x's sums of 16 off, as Q6_K takes its 32 off.
"""

from __future__ import annotations

from .block_kernel import BlockKernel, Int16X
from .mlir import Value, vector
from .product_dispatch import Block

__all__ = ["KERNEL", "X_ORDER"]

X_ORDER = tuple(range(8))  # x's groups in each super-block: in order
AHEAD = 8  # super-blocks the prefetches run ahead


def _scales(blk: Block) -> tuple[Value, Value]:
    """``(d * sc, -4 * d * sc)`` of the super-block's 16 scales (vector<16xf32> each)."""
    e, v16i = blk.e, vector(16, "i8")
    packed = blk.byte(96, 12, "sc")
    low = e.shuffle(packed, packed, [s % 8 for s in range(16)], "sl")
    low = e.binary("arith.andi", e.binary("arith.shrui", low, e.const([4 * (s // 8) for s in range(16)], v16i), "sl"), e.const(15, v16i), "sl")
    high = e.shuffle(packed, packed, [8 + s % 4 for s in range(16)], "sh")
    high = e.binary("arith.andi", e.binary("arith.shrui", high, e.const([2 * (s // 4) for s in range(16)], v16i), "sh"), e.const(3, v16i), "sh")
    sc = e.binary("arith.ori", low, e.binary("arith.shli", high, e.const(4, v16i), "sh"), "sc")
    signed = e.binary("arith.subi", sc, e.const(32, v16i), "sc")  # -32..31
    v16 = vector(16, "f32")
    (d,) = blk.halves(108)
    s = e.binary("arith.mulf", e.cast("arith.sitofp", signed, v16, "scf"), e.broadcast(d, v16), "s")
    return s, e.binary("arith.mulf", s, e.const(-4.0, v16), "o")


def _low_bits(blk: Block, qs: Value, shift: int) -> Value:
    """(vector<32xi8>) bits ``shift, shift + 1`` of the 32 bytes ``qs``."""
    e, v32 = blk.e, vector(32, "i8")
    moved = e.binary("arith.shrui", qs, e.const(shift, v32), "ql") if shift else qs
    return e.binary("arith.andi", moved, e.const(3, v32), "ql")


def _high_bit(blk: Block, hm: Value, bit: int) -> Value:
    """(vector<32xi8>) 4 where bit ``bit`` of the 32 bytes ``hm`` is set, else 0."""
    e, v32 = blk.e, vector(32, "i8")
    moved = e.binary("arith.shrui", hm, e.const(bit, v32), "hb") if bit else hm
    return e.binary("arith.shli", e.binary("arith.andi", moved, e.const(1, v32), "hb"), e.const(2, v32), "hb")


def _unsigned(blk: Block, qs: list[Value], hm: Value, c: int) -> Value:
    """(vector<32xi8>) ``u`` of values ``32 c .. 32 c + 31``."""
    h, j = divmod(c, 4)
    return blk.e.binary("arith.ori", _low_bits(blk, qs[h], 2 * j), _high_bit(blk, hm, c), "u")


def _body(blk: Block) -> None:
    e = blk.e
    blk.prefetch(AHEAD)
    s, o = _scales(blk)
    scaled = blk.scales_of_16(s, o)  # the 4s taken off
    hm = blk.byte(0, 32, "hm")
    qs = [blk.byte(32 + 32 * h, 32, "qs") for h in range(2)]
    for v in range(4):  # values 64 v .. 64 v + 63
        values = e.shuffle(_unsigned(blk, qs, hm, 2 * v), _unsigned(blk, qs, hm, 2 * v + 1), range(64), "u")
        for i in range(blk.m):
            blk.x16_accumulate(i, values, 64 * v, scaled[i], [4 * v + lane // 4 for lane in range(16)])


def _values(blk: Block) -> list[tuple[int, Value]]:
    """A super-block's 256 values in order, 32 at a time: ``d * (sc - 32) * u - 4 d (sc - 32)``."""
    e, v32 = blk.e, vector(32, "f32")
    s, o = _scales(blk)
    hm = blk.byte(0, 32, "hm")
    qs = [blk.byte(32 + 32 * h, 32, "qs") for h in range(2)]
    out = []
    for c in range(8):
        picks = [2 * c] * 16 + [2 * c + 1] * 16
        scale, offset = e.shuffle(s, s, picks, "sj"), e.shuffle(o, o, picks, "oj")
        out.append((32 * c, e.fma(e.cast("arith.uitofp", _unsigned(blk, qs, hm, c), v32, "qf"), scale, offset, "wv")))
    return out


KERNEL = BlockKernel("Q3_K", _body, rows_per_workgroup=64, rows_at_once=2, accumulators=(16, 16), int16=Int16X(X_ORDER, sum_group=16), values=_values)
