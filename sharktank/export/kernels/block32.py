"""What the legacy 32-value layouts' kernels (Q4_0, Q4_1, Q5_0, Q5_1) share: their values
are 4 bits in 16 bytes (low nibbles: values 0-15, high nibbles: 16-31), Q5's with a fifth bit
per value from 4 more bytes, and a block's 32 values are ``d * (q - z)`` (Q4_0: z = 8, Q5_0:
z = 16) or ``d * q + m`` (Q4_1, Q5_1), q unsigned.

The kernels take x as 16-bit integers per 32 values (:mod:`.int16_x`, planes of 64 values
in :data:`X_ORDER`) and two blocks a step (:attr:`.BlockKernel.blocks_per_step`), so that one step's 64 unsigned
values fill a 64-byte ``vpdpbusd`` (:func:`pair_product`): per row of x, ``d * scale`` of
each block times the exact integer dot with x's values, and ``m`` (or ``-z * d``) times x's
sum over the block (:mod:`.int16_x`'s sums) in a second, 2-lane accumulator. x's 16-value
pieces go in :data:`X_ORDER`, so that the weights' nibbles need no shuffle into value order
(that shuffle cost about a fifth of a Q4_1 product).

Measured 2026-12-04 (``tools/bench_kernels.py --against`` a checkout of 2fd1d2a, its
defaults: 8 random weights of 2048x2048 in one function, M = 1, local-task, 2 threads; old and
new code alternately, two pairs): us a product, float32-x form (the values widened to float32 and
multiplied with float32 x) -> this one: Q4_0 211 -> 135 and 161 -> 119, Q4_1 195 -> 127 and
151 -> 111, Q5_0 247 -> 182 and 195 -> 162, Q5_1 258 -> 166 and 204 -> 144 (Q4_K, unchanged,
109/99 and 84/84). Against the float64 product with the true x, 2e-5 of the largest value
(int16 x), against 2e-7 before.
"""

from __future__ import annotations

from .block_kernel import BlockKernel, Int16X
from .product_dispatch import Block
from .mlir import Value, vector

__all__ = ["X_ORDER", "fifth_bits", "fifth_bit_pair", "nibble_pair", "pair_product", "signed_byte", "block_values", "legacy_kernel"]

_V32 = vector(32, "i8")
# x's 16-value pieces in each plane of 64 (two blocks), as the kernels read them: the blocks'
# low nibbles are their values 0-15 and the high nibbles 16-31, so one ``and`` and one shift of
# the two blocks' 32 bytes give pieces 0, 2 (first block's 0-15, second's) and 1, 3.
X_ORDER = (0, 2, 1, 3)


def signed_byte(bits: int) -> int:
    """An 8-bit pattern as the signed i8 literal MLIR takes."""
    return bits - 256 if bits > 127 else bits


def fifth_bits(blk: Block, offset: int, block: int = 0) -> Value:
    """(vector<32xi8>) 16 where value i's fifth bit is set, else 0: bit ``i % 8`` of byte ``i
    // 8`` of the 4 bytes at ``offset`` (bit i of their little-endian word)."""
    e = blk.e
    packed = blk.byte(offset, 4, "qh", block)
    spread = e.shuffle(packed, packed, [i // 8 for i in range(32)], "qh")
    bits = e.binary("arith.andi", spread, e.const([signed_byte(1 << (i % 8)) for i in range(32)], _V32), "qh")
    is_set = e.cmp("arith.cmpi", "ne", bits, e.const(0, _V32), "set")
    return e.select(is_set, e.const(16, _V32), e.const(0, _V32), "q5")


def nibble_pair(blk: Block, offset: int) -> Value:
    """(vector<64xi8>) the 4-bit values of the step's two blocks (16 bytes at ``offset`` each)
    in :data:`X_ORDER`: values 0-15 of the first block (its low nibbles), of the second, then
    values 16-31 (high nibbles) of the first and of the second."""
    e = blk.e
    packed = e.shuffle(blk.byte(offset, 16, block=0), blk.byte(offset, 16, block=1), range(32), "qq")
    low = e.binary("arith.andi", packed, e.const(15, _V32), "lo")
    high = e.binary("arith.shrui", packed, e.const(4, _V32), "hi")
    return e.shuffle(low, high, range(64), "q")


def fifth_bit_pair(blk: Block, offset: int) -> Value:
    """(vector<64xi8>) :func:`fifth_bits` of the step's two blocks, in :data:`X_ORDER`."""
    first, second = fifth_bits(blk, offset, 0), fifth_bits(blk, offset, 1)
    return blk.e.shuffle(first, second, [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)], "q5")


def pair_product(blk: Block, values: Value, d: Value, m: Value) -> None:
    """Every row's accumulators += the step's two blocks ``d * values + m`` times x:
    ``values`` vector<64xi8> unsigned, ``d`` and ``m`` vector<2xf32> (one per block). Slot 0
    (16 lanes, 4 per piece of :data:`X_ORDER`) takes ``d * scale`` times the integer dot with x's values, slot 1
    (2 lanes) ``m`` times x's sums of the two blocks."""
    e, v2 = blk.e, vector(2, "f32")
    for i in range(blk.m):
        at = [blk.rows[i], blk.b]  # x's groups are the blocks (GROUP = 32)
        scaled = e.binary("arith.mulf", d, e.load(blk.xd, at, v2, "xd"), "sx")
        blk.x16_accumulate(i, values, 0, scaled, ([0] * 4 + [1] * 4) * 2)  # lanes: 4 per X_ORDER piece
        blk.fma(i, m, e.load(blk.xs, at, v2, "xs"), 1)


def pair_scales(blk: Block, count: int) -> list[Value]:
    """The ``count`` float16 numbers at each block's start, as vector<2xf32> over the step's
    two blocks (``d``, or ``d`` and ``m``)."""
    e = blk.e
    first, second = blk.half_vector(0, count, 0), blk.half_vector(0, count, 1)
    return [e.shuffle(first, second, [j, count + j], "dm") for j in range(count)]


def block_values(blk: Block, qs_at: int, qh_at: int | None = None, zero: int | None = None) -> list[tuple[int, Value]]:
    """One block's 32 values in order (:attr:`.BlockKernel.values`): ``d * q + m`` with ``q``
    the 4-bit values at ``qs_at`` (low nibbles: values 0-15), their fifth bits at ``qh_at``
    (Q5_x), and ``m`` the float16 after ``d`` or, with ``zero``, ``-zero * d`` (Q4_0, Q5_0)."""
    e, v32 = blk.e, vector(32, "f32")
    packed = blk.byte(qs_at, 16)
    low = e.binary("arith.andi", packed, e.const(15, vector(16, "i8")), "lo")
    high = e.binary("arith.shrui", packed, e.const(4, vector(16, "i8")), "hi")
    q = e.shuffle(low, high, range(32), "q")
    if qh_at is not None:
        q = e.binary("arith.ori", q, fifth_bits(blk, qh_at), "q")
    d, *rest = blk.halves(0, 1 if zero is not None else 2)
    m = e.binary("arith.mulf", d, e.const(float(-zero), "f32"), "m") if zero is not None else rest[0]
    qf = e.cast("arith.uitofp", q, v32, "qf")
    return [(0, e.fma(qf, e.broadcast(d, v32, "d"), e.broadcast(m, v32, "m"), "wv"))]


def legacy_kernel(layout: str, body, values=None) -> BlockKernel:
    """The :class:`.BlockKernel` of a legacy layout's ``body`` (int16 x, two blocks a step) and
    ``values`` (its prefill's: :func:`block_values`)."""
    return BlockKernel(layout, body, rows_per_workgroup=64, rows_at_once=2, accumulators=(16, 2), int16=Int16X(X_ORDER, unit=16), blocks_per_step=2, values=values)
