"""The Q5_K block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch, with
``x`` as 16-bit integers per 32 values (:mod:`.int16_x`) and integer dot products: Q4_K's
kernel (:mod:`.q4_k`, the same scales, mins and order of x) with each value's fifth bit.

Per 176-byte super-block of 256 values: ``d``, ``dmin``, the 12 bytes of 6-bit scales and
mins, 32 bytes ``qh`` and 128 bytes of low 4 bits as Q4_K's. Value ``l`` of sub-block ``j``
(of 32) has its fifth bit at bit ``j`` of ``qh[l]``; the unsigned 5-bit values (0-31) go into
``vpdpbusd`` as Q4_K's nibbles do.
"""

from __future__ import annotations

from .block32 import signed_byte
from .block_kernel import BlockKernel, Int16X
from .mlir import Value, vector
from .product_dispatch import Block
from .q4_k import X_ORDER, nibble_products, scales_and_mins, values, x_scales

__all__ = ["KERNEL"]

AHEAD = 10  # super-blocks the prefetches run ahead (1.7 KB)
_V64 = vector(64, "i8")


def _with_fifth(blk: Block, values: Value, spread: Value, a: int) -> Value:
    """``values`` (sub-blocks ``a`` then ``a + 2``, 32 lanes each) with 16 added where the
    value's fifth bit (bit ``a``, then ``a + 2``, of ``spread``'s lane) is set."""
    e = blk.e
    masks = [signed_byte(1 << a)] * 32 + [signed_byte(1 << (a + 2))] * 32
    is_set = e.cmp("arith.cmpi", "ne", e.binary("arith.andi", spread, e.const(masks, _V64), "qh"), e.const(0, _V64), "set")
    return e.binary("arith.ori", values, e.select(is_set, e.const(16, _V64), e.const(0, _V64), "q5"), "q")


def _body(blk: Block) -> None:
    e = blk.e
    blk.prefetch(AHEAD)
    s, o = scales_and_mins(blk)
    scaled = x_scales(blk, s, o, 1)
    qh = blk.byte(16, 32, "qh")
    spread = e.shuffle(qh, qh, [*range(32), *range(32)], "qh")  # byte l for lanes l and 32 + l
    for run in range(2):  # bytes 64 run .. + 64: sub-blocks 4 run + (0, 2) low, (1, 3) high
        q = blk.byte(48 + 64 * run, 64)
        low = _with_fifth(blk, e.binary("arith.andi", q, e.const(15, _V64), "lo"), spread, 4 * run)
        high = _with_fifth(blk, e.binary("arith.shrui", q, e.const(4, _V64), "hi"), spread, 4 * run + 1)
        nibble_products(blk, run, low, high, scaled)


KERNEL = BlockKernel("Q5_K", _body, rows_per_workgroup=64, rows_at_once=2, accumulators=(16, 8), int16=Int16X(X_ORDER), values=lambda blk: values(blk, qh_at=16))
