"""The Q6_K block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch, with
``x`` as 16-bit integers per 32 values (:mod:`.int16_x`) and integer dot products.

Per weight row, per 210-byte super-block of 256 values: it loads the 16 int8 scales and
``d`` (float16) and forms ``d * sc`` (16 float32, one per 16 values); then per half of 128
values it loads the 64 bytes of low 4 bits and the 32 bytes of high 2 bits, and assembles the
unsigned 6-bit values ``u = q + 32`` of values 0-63 (low nibbles, high bits 0-3) and 64-127
(high nibbles, high bits 4-7) with byte ``and``/shift ops, 64 values a vector in order. Per
such vector and row of ``x`` it takes ``vpdpbusd`` with x's high bytes, shifts the sums by 8
bits and adds ``vpdpbusd`` with its low bytes (16 int32 lanes, 4 per 16 values: exact),
converts them and adds them times ``d * sc * scale`` (x's group scale). The 32 taken off
every value is one 16-lane fma a super-block and row: ``-32 * d * sc`` times x's sums of 16.

With the weights read from memory (2 Zen4 cores, interleaved rounds), the 1B model's
128256x2048 output product took 10.4 ms against 20.5 ms for the float32 form it replaces
(values widened, converted and scaled in float32 lanes), 8 weights of 8192x2048 in turn 0.75
against 1.41 ms a product. The result is 2e-5 of the product's largest value away from the
float product with unrounded x (see :mod:`.int16_x`).
"""

from __future__ import annotations

from .block_kernel import BlockKernel, Int16X
from .product_dispatch import Block
from .mlir import Value, vector

__all__ = ["KERNEL", "X_ORDER"]

X_ORDER = tuple(range(8))  # x's groups in each super-block: in order
AHEAD = 8  # super-blocks the prefetches run ahead (1.7 KB)


def _body(blk: Block) -> None:
    e, v16, v32, v64 = blk.e, vector(16, "f32"), vector(32, "i8"), vector(64, "i8")
    blk.prefetch(AHEAD)
    scf = e.cast("arith.sitofp", blk.byte(192, 16, "sc"), v16, "scf")
    (d,) = blk.halves(208)
    s = e.binary("arith.mulf", scf, e.broadcast(d, v16), "s")  # d * sc per 16 values
    o = e.binary("arith.mulf", s, e.const(-32.0, v16), "o")
    k4, k15, k48 = (e.const(v, v64) for v in (4, 15, 48))
    scaled = blk.scales_of_16(s, o)  # the 32s taken off
    for h in range(2):
        low, high = blk.byte(64 * h, 64, "l"), blk.byte(128 + 32 * h, 32, "h")
        shifted = e.binary("arith.shrui", high, e.const(2, v32), "hs")  # bits 2-3 (and 6-7) where 0-1 (4-5) were
        paired = e.shuffle(high, shifted, range(64), "hp")
        bits_a = e.binary("arith.andi", e.binary("arith.shli", paired, k4), k48, "ha")
        first = e.binary("arith.ori", e.binary("arith.andi", low, k15), bits_a, "u")  # values 128 h + 0..63
        bits_b = e.binary("arith.andi", paired, k48, "hb")
        second = e.binary("arith.ori", e.binary("arith.shrui", low, k4), bits_b, "u")  # values 128 h + 64..127
        for half, values in ((0, first), (1, second)):
            at, c = 128 * h + 64 * half, 8 * h + 4 * half  # its first value; its first scale
            for i in range(blk.m):
                blk.x16_accumulate(i, values, at, scaled[i], [c + lane // 4 for lane in range(16)])


def _values(blk: Block) -> list[tuple[int, Value]]:
    """A super-block's 256 values in order: per half h of 128, the 64 bytes of low 4 bits
    (low nibbles: values 0-63, high: 64-127) and 32 bytes of high 2 bits (bits 2i, 2i + 1 of
    byte l: value 32 i + l), ``d * sc[t // 16] * (q - 32)``."""
    e, v16, v32, i32 = blk.e, vector(16, "f32"), vector(32, "f32"), vector(32, "i8")
    scf = e.cast("arith.sitofp", blk.byte(192, 16, "sc"), v16, "scf")
    (d,) = blk.halves(208)
    s = e.binary("arith.mulf", scf, e.broadcast(d, v16), "s")
    o = e.binary("arith.mulf", s, e.const(-32.0, v16), "o")
    out = []
    for h in range(2):
        ql = [blk.byte(64 * h + 32 * i, 32, "l") for i in range(2)]
        qh = blk.byte(128 + 32 * h, 32, "h")
        for i in range(4):  # values 128 h + 32 i .. + 31
            nibble = ql[i % 2]
            nibble = e.binary("arith.andi", nibble, e.const(15, i32), "lo") if i < 2 else e.binary("arith.shrui", nibble, e.const(4, i32), "hi")
            top = e.binary("arith.andi", e.binary("arith.shrui", qh, e.const(2 * i, i32), "qh"), e.const(3, i32), "qh")
            q = e.binary("arith.ori", nibble, e.binary("arith.shli", top, e.const(4, i32), "qh"), "q")
            t = (128 * h + 32 * i) // 16  # the first of its two scales
            picks = [t] * 16 + [t + 1] * 16
            scale, offset = e.shuffle(s, s, picks, "sj"), e.shuffle(o, o, picks, "oj")
            out.append((128 * h + 32 * i, e.fma(e.cast("arith.uitofp", q, v32, "qf"), scale, offset, "wv")))
    return out


KERNEL = BlockKernel("Q6_K", _body, rows_per_workgroup=64, rows_at_once=2, accumulators=(16, 16), int16=Int16X(X_ORDER, sum_group=16), values=_values)
