"""The Q4_K block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch.

Per weight row, per 144-byte super-block of 256 values: it decodes ``d`` and ``dmin``
(float16) and the eight 6-bit scale/min pairs packed in 12 bytes with vector ``and``/shift
ops on the bytes (``d * sc_j`` and ``-dmin * m_j`` in float32); widens each 32-byte run of
packed values to 32-bit lanes once and splits it into its two sub-blocks' nibbles there;
and per sub-block and row of ``x`` adds ``d * sc_j * sum(x * q)`` (``sum(x * q)`` in 16
lanes) into the row's accumulator. The mins' share, ``-dmin * m_j * sum(x)``, takes one
8-lane fma per super-block and row: each workgroup first sums ``x`` per 32 columns.

8192x2048, IREE 3.10 local-task on 2 Zen4 cores (shared machine; medians of two runs of
9 rounds interleaved with bf16 dense and the torch form): M=1 0.66-0.76 ms (bf16 dense
0.93-1.21 ms, the torch form 1.8-2.8 ms); M=8 2.1-4.1 ms (bf16 1.6-1.7 ms, torch 11-13 ms). The read
limit (0.5625 bytes a weight, ~30 GB/s) is 0.31 ms: this is bound by the FP pipes (per
super-block 8 widenings, 16 conversions and 24 mul/fma of 16 lanes per row of x; 0.96 ms
on one thread). Tried: forming the values first (``q * d*sc_j - dmin*m_j``, then one
fma per row) 0.74 ms at M=1 (1.28 ms on one thread), the same at M=8; nibbles split in
bytes before widening 0.59 ms (1.04); 16 or 128 rows a workgroup 0.64 / 0.58 ms; 2 or 4
accumulator chains no change.
"""

from __future__ import annotations

from . import dispatch

KERNEL = dispatch.Kernel("q4_k", block_size=256, block_bytes=144, rows_per_workgroup=64, width=16, rows_at_once=2)


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


def _x_sums(block: dispatch.Block) -> str:
    """The workgroup's prologue: ``%xs`` [m, k/32], each row's sums of 32 columns of ``x``."""
    ng, elem = block.k // 32, block.elem
    xs_t = f"memref<{block.m}x{ng}xf32>"
    lines = []
    for i in range(block.m):
        lines.append(f"%xg{i} = vector.load %x[%r{i}, %gk] : {block.x_t}, vector<32x{elem}>")
        x = f"%xg{i}"
        if elem != "f32":
            lines.append(f"%xg{i}f = arith.extf %xg{i} : vector<32x{elem}> to vector<32xf32>")
            x += "f"
        lines += [f"%xr{i} = vector.reduction <add>, {x} : vector<32xf32> into f32", f"memref.store %xr{i}, %xs[%r{i}, %g] : {xs_t}"]
    body = "\n".join("  " + line for line in lines)
    return f"""{block.scratch("%xs", (block.m, ng))}
%c32 = arith.constant 32 : index
%cng = arith.constant {ng} : index
scf.for %g = %c0 to %cng step %c1 {{
  %gk = arith.muli %g, %c32 : index
{body}
}}"""


def _half(v: str, at: int) -> str:
    return f"vector.extract_strided_slice {v} {{offsets = [{at}], sizes = [16], strides = [1]}} : vector<32xf32> to vector<16xf32>"


def _sub_blocks(block: dispatch.Block) -> list[str]:
    """Lines that leave sub-block j's 32 values ``q`` as float32 halves ``%fa{j}``, ``%fb{j}``:
    each 32-byte run widened to 32-bit lanes once, its nibbles split there."""
    v32, w32 = "vector<32xi8>", "vector<32xi32>"
    lines = [f"%w15 = arith.constant dense<15> : {w32}", f"%w4 = arith.constant dense<4> : {w32}"]
    for p in range(4):  # run p: sub-blocks 2p (low nibbles) and 2p+1 (high nibbles)
        lines += [block.byte(16 + 32 * p, 32, f"q{p}"), f"%qw{p} = arith.extui %q{p} : {v32} to {w32}"]
        for j, op in ((2 * p, "andi"), (2 * p + 1, "shrui")):
            lines += [
                f"%n{j} = arith.{op} %qw{p}, {'%w15' if op == 'andi' else '%w4'} : {w32}",
                f"%f{j} = arith.sitofp %n{j} : {w32} to vector<32xf32>",
                f"%fa{j} = {_half(f'%f{j}', 0)}",
                f"%fb{j} = {_half(f'%f{j}', 16)}",
            ]
    return lines


def _scaled_sums(block: dispatch.Block) -> list[str]:
    """Per sub-block j and row: ``sum(x * q)`` in 16 lanes, times ``d * sc_j``; the mins'
    share once per super-block, ``-dmin * m`` dot the workgroup's sums of ``x`` (prologue)."""
    block.prologue = _x_sums(block)
    offsets = block.add_accumulator("vector<8xf32>")
    xs_t = f"memref<{block.m}x{block.k // 32}xf32>"
    lines = ["%c8 = arith.constant 8 : index", "%b8 = arith.muli %b, %c8 : index"]
    for i in range(block.m):
        lines += [f"%xs8_{i} = vector.load %xs[%r{i}, %b8] : {xs_t}, vector<8xf32>", block.fma(i, "%o", f"%xs8_{i}", offsets, "m")]
    for j in range(8):
        lines += [f"%s{j} = vector.extract %s[{j}] : f32 from vector<8xf32>", f"%sv{j} = vector.broadcast %s{j} : f32 to vector<16xf32>"]
        for i in range(block.m):
            lines += [
                block.load_x(i, 32 * j, 16, f"xa{j}_{i}"),
                block.load_x(i, 32 * j + 16, 16, f"xb{j}_{i}"),
                f"%p{j}_{i} = arith.mulf %fa{j}, %xa{j}_{i} : vector<16xf32>",
                f"%pp{j}_{i} = vector.fma %fb{j}, %xb{j}_{i}, %p{j}_{i} : vector<16xf32>",
                block.fma(i, f"%pp{j}_{i}", f"%sv{j}", tag=f"g{j}"),
            ]
    return lines


def _body(block: dispatch.Block) -> str:
    return "\n".join([_scales(block), *_sub_blocks(block), *_scaled_sums(block)])


def function_name(m: int, n: int, k: int, elem: str) -> str:
    return KERNEL.function_name(m, n, k, elem)


def module_asm(m: int, n: int, k: int, elem: str) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>, blocks:
    tensor<n x k/256 x 144 x i8>) -> tensor<m x n x elem>`` and the dispatch it calls."""
    return dispatch.module_asm(KERNEL, m, n, k, elem, _body)
