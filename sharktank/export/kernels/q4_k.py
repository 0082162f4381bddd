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

from . import dispatch

KERNEL = dispatch.Kernel("q4_k", block_size=256, block_bytes=144, rows_per_workgroup=64, width=16, rows_at_once=2, elements=("i16",))
ELEMENTS = KERNEL.elements  # int16 x only: float x goes through int16_x.quantize
X_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # x's groups in each super-block, as the kernel reads them
AHEAD = 12  # super-blocks the prefetches run ahead (1.7 KB)


def _scales(block: dispatch.Block) -> str:
    """``%s`` and ``%o`` (vector<8xf32>): each sub-block's ``d * sc_j`` and ``-dmin * m_j``.
    Sub-block j < 4 takes the low 6 bits of bytes j (scale) and j+4 (min); j >= 4 a nibble of
    byte j+4 (low: scale, high: min) under the top 2 bits of byte j-4 (scale) or j (min)."""
    v4 = "vector<4xi8>"

    def part(name: str, at: int) -> str:
        return f"%{name} = vector.extract_strided_slice %sb {{offsets = [{at}], sizes = [4], strides = [1]}} : vector<12xi8> to {v4}"

    return f"""{block.byte(0, 4, "dd")}
%ddh = vector.bitcast %dd : vector<4xi8> to vector<2xf16>
%ddf = arith.extf %ddh : vector<2xf16> to vector<2xf32>
%d = vector.extract %ddf[0] : f32 from vector<2xf32>
%dmin = vector.extract %ddf[1] : f32 from vector<2xf32>
{block.byte(4, 12, "sb")}
{part("lo", 0)}
{part("hi", 4)}
{part("tl", 8)}
%k63 = arith.constant dense<63> : {v4}
%k15 = arith.constant dense<15> : {v4}
%k4 = arith.constant dense<4> : {v4}
%k6 = arith.constant dense<6> : {v4}
%sc_lo = arith.andi %lo, %k63 : {v4}
%mn_lo = arith.andi %hi, %k63 : {v4}
%lo_top = arith.shrui %lo, %k6 : {v4}
%lo_top4 = arith.shli %lo_top, %k4 : {v4}
%tl_low = arith.andi %tl, %k15 : {v4}
%sc_hi = arith.ori %tl_low, %lo_top4 : {v4}
%hi_top = arith.shrui %hi, %k6 : {v4}
%hi_top4 = arith.shli %hi_top, %k4 : {v4}
%tl_high = arith.shrui %tl, %k4 : {v4}
%mn_hi = arith.ori %tl_high, %hi_top4 : {v4}
%sc = vector.shuffle %sc_lo, %sc_hi [0, 1, 2, 3, 4, 5, 6, 7] : {v4}, {v4}
%mn = vector.shuffle %mn_lo, %mn_hi [0, 1, 2, 3, 4, 5, 6, 7] : {v4}, {v4}
%scf = arith.uitofp %sc : vector<8xi8> to vector<8xf32>
%mnf = arith.uitofp %mn : vector<8xi8> to vector<8xf32>
%dv = vector.broadcast %d : f32 to vector<8xf32>
%ndmin = arith.negf %dmin : f32
%nmv = vector.broadcast %ndmin : f32 to vector<8xf32>
%s = arith.mulf %scf, %dv : vector<8xf32>
%o = arith.mulf %mnf, %nmv : vector<8xf32>"""


def _body(block: dispatch.Block) -> str:
    offsets = block.add_accumulator("vector<8xf32>")
    v64 = "vector<64xi8>"
    lines = [
        block.prefetch(AHEAD),
        _scales(block),
        f"%b15 = arith.constant dense<15> : {v64}",
        f"%b4 = arith.constant dense<4> : {v64}",
        "%c8 = arith.constant 8 : index",
        "%b8 = arith.muli %b, %c8 : index",
    ]
    for i in range(block.m):  # the mins' share; each sub-block's weight scale times x's
        lines += [
            f"%xs8_{i} = vector.load %xs[%r{i}, %b8] : {block.sums_t}, vector<8xf32>",
            block.fma(i, "%o", f"%xs8_{i}", offsets, "m"),
            f"%xd8_{i} = vector.load %xd[%r{i}, %b8] : {block.group_t}, vector<8xf32>",
            f"%sx{i} = arith.mulf %s, %xd8_{i} : vector<8xf32>",
        ]
    for run in range(2):  # bytes 64 run .. + 64: sub-blocks 4 run + (0, 2) low, (1, 3) high
        lines += [block.byte(16 + 64 * run, 64, f"q{run}"), f"%lo{run} = arith.andi %q{run}, %b15 : {v64}", f"%hi{run} = arith.shrui %q{run}, %b4 : {v64}"]
        for h, nibbles in ((0, f"%lo{run}"), (1, f"%hi{run}")):
            a, at = 4 * run + h, 128 * run + 64 * h  # lanes 0-7: sub-block a, 8-15: a + 2
            for i in range(block.m):
                t = f"{run}{h}_{i}"
                lines.append(block.x16_accumulate(i, nibbles, at, f"%sx{i}", 8, [a] * 8 + [a + 2] * 8, t))
    return "\n".join(lines)


def function_name(m: int, n: int, k: int, elem: str, y: str | None = None) -> str:
    return KERNEL.function_name(m, n, k, elem, y)


def module_asm(m: int, n: int, k: int, elem: str = "i16", y: str | None = None) -> str:
    """A module holding ``util.func @<function_name>(planes: tensor<m x 2k x i8>, scales, sums:
    tensor<m x k/32 x f32>, blocks: tensor<n x k/256 x 144 x i8>) -> tensor<m x n x y>``
    and the dispatch it calls (``planes`` as ``int16_x.quantize(x, X_ORDER)`` makes them; ``y``: f32, the default, bf16 or f16)."""
    return dispatch.module_asm(KERNEL, m, n, k, elem, _body, y)
