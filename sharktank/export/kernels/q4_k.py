"""The Q4_K block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch, with
``x`` as 16-bit integers per 32 values (:mod:`.int16_x`) and integer dot products.

Per weight row, per 144-byte super-block of 256 values: it decodes ``d`` and ``dmin``
(float16) and the eight 6-bit scale/min pairs packed in 12 bytes with vector ``and``/shift
ops on the bytes (``d * sc_j`` and ``-dmin * m_j`` in float32); loads the 128 bytes of packed
values as two runs of 64, whose low and high nibbles are two sub-blocks' unsigned values
each (``and``, shift); and per run, nibble half and row of ``x`` takes ``vpdpbusd`` of the 64
nibbles with x's high bytes, shifts the sums by 8 bits and adds ``vpdpbusd`` with its low
bytes (16 int32 lanes, 8 per sub-block: exact), converts them to float32 and adds them times
``d * sc_j * scale_j`` (``scale_j``: x's group scale) into the row's accumulator. The mins'
share, ``-dmin * m_j * sum_j`` (x's group sums), takes one 8-lane fma per super-block and row.
Nibble halves pair sub-blocks (0, 2), (1, 3), (4, 6), (5, 7): :data:`X_ORDER` is x's order.

With the weights read from memory (8 weights in turn, 2 Zen4 cores, interleaved rounds),
8192x2048 took 0.37 ms a product against 0.59 ms for the float32 form it replaces (values
widened to 32-bit lanes, converted, multiplied with float32 x), 2048x8192 0.46 against
0.84 ms. Where one row of x's planes is 16 KiB or more, two weight rows go at once. Against
int8 x (one ``vpdpbusd`` per 64 values, llama.cpp's scheme), about as fast at 8192x2048, and
the result is 2e-5 of the product's largest value away from the float product instead of
5e-3 (see :mod:`.int16_x`).
"""

from __future__ import annotations

from .block_kernel import BlockKernel, Int16X
from .product_dispatch import Block
from .mlir import Value, vector

__all__ = ["KERNEL", "X_ORDER", "nibble_products", "scales_and_mins", "scaled_values", "values", "x_scales"]

X_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # x's groups in each super-block, as the kernel reads them
AHEAD = 12  # super-blocks the prefetches run ahead (1.7 KB)


def scales_and_mins(blk: Block) -> tuple[Value, Value]:
    """(vector<8xf32>) each sub-block's ``d * sc_j`` and ``-dmin * m_j`` (Q4_K, Q5_K: the 16
    bytes at the block's start). Sub-block j < 4 takes the low 6 bits of bytes j (scale) and
    j+4 (min); j >= 4 a nibble of byte j+4 (low: scale, high: min) under the top 2 bits of
    byte j-4 (scale) or j (min)."""
    e, v4 = blk.e, vector(4, "i8")
    d, dmin = blk.halves(0, 2)
    packed = blk.byte(4, 12, "sb")
    lo, hi, tail = (e.slice(packed, at, 4, name) for at, name in ((0, "lo"), (4, "hi"), (8, "tl")))
    k63, k15, k4, k6 = (e.const(v, v4) for v in (63, 15, 4, 6))

    sc_lo, mn_lo = e.binary("arith.andi", lo, k63, "sc"), e.binary("arith.andi", hi, k63, "mn")
    top = e.binary("arith.shli", e.binary("arith.shrui", lo, k6), k4)  # (byte >> 6) << 4
    sc_hi = e.binary("arith.ori", e.binary("arith.andi", tail, k15), top, "sc")
    top = e.binary("arith.shli", e.binary("arith.shrui", hi, k6), k4)
    mn_hi = e.binary("arith.ori", e.binary("arith.shrui", tail, k4), top, "mn")
    sc = e.shuffle(sc_lo, sc_hi, range(8), "sc")
    mn = e.shuffle(mn_lo, mn_hi, range(8), "mn")
    v8 = vector(8, "f32")
    scf, mnf = e.cast("arith.uitofp", sc, v8, "scf"), e.cast("arith.uitofp", mn, v8, "mnf")
    s = e.binary("arith.mulf", scf, e.broadcast(d, v8), "s")
    o = e.binary("arith.mulf", mnf, e.broadcast(e.unary("arith.negf", dmin), v8), "o")
    return s, o


def x_scales(blk: Block, s: Value, offsets: Value, slot: int) -> list[Value]:
    """Per row of x: the mins' share added (``offsets`` times x's sums, into ``slot``), and
    each sub-block's weight scale ``s`` times x's group scale (vector<8xf32>)."""
    e, v8 = blk.e, vector(8, "f32")
    b8 = e.binary("arith.muli", blk.b, e.const(8), "b8")
    scaled = []
    for i in range(blk.m):
        blk.fma(i, offsets, e.load(blk.xs, [blk.rows[i], b8], v8, "xs"), slot)
        scaled.append(e.binary("arith.mulf", s, e.load(blk.xd, [blk.rows[i], b8], v8, "xd"), "sx"))
    return scaled


def nibble_products(blk: Block, run: int, low: Value, high: Value, scaled: list[Value]) -> None:
    """Every row's accumulator += the products of run ``run``'s 64 bytes of values (sub-blocks
    4 run + (0, 2) in ``low``, (1, 3) in ``high``, unsigned bytes) with x."""
    for h, values in ((0, low), (1, high)):
        a, at = 4 * run + h, 128 * run + 64 * h  # lanes 0-7: sub-block a, 8-15: a + 2
        for i in range(blk.m):
            blk.x16_accumulate(i, values, at, scaled[i], [a] * 8 + [a + 2] * 8)


def _body(blk: Block) -> None:
    e, v64 = blk.e, vector(64, "i8")
    blk.prefetch(AHEAD)
    s, o = scales_and_mins(blk)
    scaled = x_scales(blk, s, o, 1)
    for run in range(2):  # bytes 64 run .. + 64: sub-blocks 4 run + (0, 2) low, (1, 3) high
        q = blk.byte(16 + 64 * run, 64)
        low = e.binary("arith.andi", q, e.const(15, v64), "lo")
        high = e.binary("arith.shrui", q, e.const(4, v64), "hi")
        nibble_products(blk, run, low, high, scaled)


def scaled_values(blk: Block, s: Value, o: Value, q: Value, sub: int) -> Value:
    """(vector<32xf32>) sub-block ``sub``'s values ``s_j * q + o_j`` (``q`` vector<32xi8>
    unsigned; ``s``, ``o``: :func:`scales_and_mins`)."""
    e, v32 = blk.e, vector(32, "f32")
    scale, offset = (e.broadcast(e.extract(v, sub, "sj"), v32, "sj") for v in (s, o))
    return e.fma(e.cast("arith.uitofp", q, v32, "qf"), scale, offset, "wv")


def values(blk: Block, qh_at: int | None = None) -> list[tuple[int, Value]]:
    """A super-block's 256 values in order (Q4_K; Q5_K with its fifth bits at ``qh_at``):
    bytes ``32 j .. 32 j + 31`` of the packed values hold sub-block ``2 j`` in their low
    nibbles and ``2 j + 1`` in their high ones."""
    e, v32 = blk.e, vector(32, "i8")
    s, o = scales_and_mins(blk)
    qh = None if qh_at is None else blk.byte(qh_at, 32, "qh")
    qs_at = 16 if qh_at is None else 48
    out = []
    for j in range(4):
        q = blk.byte(qs_at + 32 * j, 32)
        for half, nibble in enumerate((e.binary("arith.andi", q, e.const(15, v32), "lo"), e.binary("arith.shrui", q, e.const(4, v32), "hi"))):
            sub = 2 * j + half
            if qh is not None:  # value l's fifth bit: bit ``sub`` of qh[l]
                bit = e.binary("arith.andi", qh, e.const(1 << sub if sub < 7 else -128, v32), "qb")
                is_set = e.cmp("arith.cmpi", "ne", bit, e.const(0, v32), "set")
                nibble = e.binary("arith.ori", nibble, e.select(is_set, e.const(16, v32), e.const(0, v32), "q5"), "q")
            out.append((32 * sub, scaled_values(blk, s, o, nibble, sub)))
    return out


KERNEL = BlockKernel("Q4_K", _body, rows_per_workgroup=64, rows_at_once=2, accumulators=(16, 8), int16=Int16X(X_ORDER), values=values)
