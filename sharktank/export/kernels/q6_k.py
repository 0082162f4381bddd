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

from . import dispatch

KERNEL = dispatch.Kernel("q6_k", block_size=256, block_bytes=210, rows_per_workgroup=64, width=16, rows_at_once=2, elements=("i16",), sum_group=16)
ELEMENTS = KERNEL.elements  # int16 x only: float x goes through int16_x.quantize
X_ORDER = tuple(range(8))  # x's groups in each super-block: in order
AHEAD = 8  # super-blocks the prefetches run ahead (1.7 KB)


def _body(block: dispatch.Block) -> str:
    offsets = block.add_accumulator("vector<16xf32>")
    v32, v64 = "vector<32xi8>", "vector<64xi8>"
    pairs = ", ".join(str(j // 2) for j in range(16))  # x's group scale of each 16 values
    lines = [
        block.prefetch(AHEAD),
        block.byte(192, 16, "sc"),
        "%scf = arith.sitofp %sc : vector<16xi8> to vector<16xf32>",
        block.byte(208, 2, "db"),
        "%dh = vector.bitcast %db : vector<2xi8> to vector<1xf16>",
        "%df = arith.extf %dh : vector<1xf16> to vector<1xf32>",
        "%d = vector.extract %df[0] : f32 from vector<1xf32>",
        "%dv = vector.broadcast %d : f32 to vector<16xf32>",
        "%s = arith.mulf %scf, %dv : vector<16xf32>",  # d * sc per 16 values
        "%m32 = arith.constant dense<-32.0> : vector<16xf32>",
        "%o = arith.mulf %s, %m32 : vector<16xf32>",
        *(f"%k{c} = arith.constant dense<{c}> : {v64}" for c in (4, 15, 48)),
        f"%k2h = arith.constant dense<2> : {v32}",
        "%c8 = arith.constant 8 : index",
        "%c16 = arith.constant 16 : index",
        "%b8 = arith.muli %b, %c8 : index",
        "%b16 = arith.muli %b, %c16 : index",
    ]
    for i in range(block.m):  # the 32s taken off; each 16 values' weight scale times x's
        lines += [
            f"%xs16_{i} = vector.load %xs[%r{i}, %b16] : {block.sums_t}, vector<16xf32>",
            block.fma(i, "%o", f"%xs16_{i}", offsets, "m"),
            f"%xd8_{i} = vector.load %xd[%r{i}, %b8] : {block.group_t}, vector<8xf32>",
            f"%xd16_{i} = vector.shuffle %xd8_{i}, %xd8_{i} [{pairs}] : vector<8xf32>, vector<8xf32>",
            f"%sx{i} = arith.mulf %s, %xd16_{i} : vector<16xf32>",
        ]
    for h in range(2):
        lines += [
            block.byte(64 * h, 64, f"l{h}"),
            block.byte(128 + 32 * h, 32, f"h{h}"),
            f"%h{h}s = arith.shrui %h{h}, %k2h : {v32}",  # bits 2-3 (and 6-7) where 0-1 (4-5) were
            f"%h{h}p = vector.shuffle %h{h}, %h{h}s [{', '.join(map(str, range(64)))}] : {v32}, {v32}",
            f"%h{h}u = arith.shli %h{h}p, %k4 : {v64}",
            f"%h{h}a = arith.andi %h{h}u, %k48 : {v64}",
            f"%l{h}a = arith.andi %l{h}, %k15 : {v64}",
            f"%u{h}0 = arith.ori %l{h}a, %h{h}a : {v64}",  # values 128 h + 0..63
            f"%h{h}b = arith.andi %h{h}p, %k48 : {v64}",
            f"%l{h}b = arith.shrui %l{h}, %k4 : {v64}",
            f"%u{h}1 = arith.ori %l{h}b, %h{h}b : {v64}",  # values 128 h + 64..127
        ]
        for half in range(2):
            at, c = 128 * h + 64 * half, 8 * h + 4 * half  # its first value; its first scale
            for i in range(block.m):
                t = f"{h}{half}_{i}"
                lines.append(block.x16_accumulate(i, f"%u{h}{half}", at, f"%sx{i}", 16, [c + lane // 4 for lane in range(16)], t))
    return "\n".join(lines)


def function_name(m: int, n: int, k: int, elem: str, y: str | None = None) -> str:
    return KERNEL.function_name(m, n, k, elem, y)


def module_asm(m: int, n: int, k: int, elem: str = "i16", y: str | None = None) -> str:
    """A module holding ``util.func @<function_name>(planes: tensor<m x 2k x i8>, scales:
    tensor<m x k/32 x f32>, sums: tensor<m x k/16 x f32>, blocks: tensor<n x k/256 x 210 x
    i8>) -> tensor<m x n x y>`` and the dispatch it calls (``int16_x.quantize(x, X_ORDER,
    16)``; ``y``: f32, the default, bf16 or f16)."""
    return dispatch.module_asm(KERNEL, m, n, k, elem, _body, y)
