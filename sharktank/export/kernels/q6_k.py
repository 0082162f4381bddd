"""The Q6_K block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch.

Per weight row, per 210-byte super-block of 256 values: it loads the 16 int8 scales and
``d`` (float16) and forms ``d * sc`` (16 float32); then per half of 128 values it loads the
two 32-byte runs of low 4 bits and the 32 bytes of high 2 bits, and per group of 32 values
(``g = 2 * nibble + run``) it assembles ``(nibble of the run) | (bits 2g, 2g+1 of the high
bytes) << 4`` with vector ``and``/shift ops, subtracts 32, converts to float32, scales by
the group's two 16-value scales (one shuffle) and adds the values' products with each row
of ``x`` into per-row float32 accumulators (the frame: :mod:`.dispatch`).

8192x2048, IREE 3.10 local-task on 2 Zen4 cores (shared machine; medians of two runs of
9 interleaved rounds): M=1 0.90-1.01 ms (bf16 dense 1.17-1.25 ms, the torch form
4.4-5.2 ms); M=8 4.9-6.1 ms (bf16 1.35-2.0 ms, torch 32-42 ms). The read limit (0.82
bytes a weight, ~30 GB/s) is 0.46 ms; like Q4_K's it is bound by the FP pipes (per
super-block 16 widenings, conversions, multiplies and fmas of 16 lanes at M=1).
"""

from __future__ import annotations

from . import dispatch

KERNEL = dispatch.Kernel("q6_k", block_size=256, block_bytes=210, rows_per_workgroup=64, rows_at_once=2)
ELEMENTS = KERNEL.elements

# The high 2 bits of group g, moved to bits 4-5: a shift of the high bytes, then & 0x30.
_HIGH = {0: ("shli", 4), 1: ("shli", 2), 2: (None, 0), 3: ("shrui", 2)}


def _body(block: dispatch.Block) -> str:
    acc, v32 = block.acc, "vector<32xi8>"
    lines = [
        block.byte(192, 16, "sc"),
        "%scf = arith.sitofp %sc : vector<16xi8> to vector<16xf32>",
        block.byte(208, 2, "db"),
        "%dh = vector.bitcast %db : vector<2xi8> to vector<1xf16>",
        "%df = arith.extf %dh : vector<1xf16> to vector<1xf32>",
        "%d = vector.extract %df[0] : f32 from vector<1xf32>",
        "%dv = vector.broadcast %d : f32 to vector<16xf32>",
        "%s = arith.mulf %scf, %dv : vector<16xf32>",
        *(f"%k{c} = arith.constant dense<{c}> : {v32}" for c in (2, 4, 15, 32, 48)),
    ]
    for h in range(2):
        lines += [block.byte(64 * h, 32, f"l{h}0"), block.byte(64 * h + 32, 32, f"l{h}1"), block.byte(128 + 32 * h, 32, f"h{h}")]
        for g in range(4):
            nibble, run, t = g // 2, g % 2, f"{h}{g}"
            low = f"arith.andi %l{h}{run}, %k15" if nibble == 0 else f"arith.shrui %l{h}{run}, %k4"
            op, by = _HIGH[g]
            moved = f"%h{h}" if op is None else f"%hm{t}"
            a = 8 * h + 2 * g  # the group's scales: a (first 16 values), a + 1
            lines += [
                f"%lo{t} = {low} : {v32}",
                *([f"%hm{t} = arith.{op} %h{h}, %k{by} : {v32}"] if op else []),
                f"%hi{t} = arith.andi {moved}, %k48 : {v32}",
                f"%u{t} = arith.ori %lo{t}, %hi{t} : {v32}",
                f"%q{t} = arith.subi %u{t}, %k32 : {v32}",
                f"%f{t} = arith.sitofp %q{t} : {v32} to {acc}",
                f"%sv{t} = vector.shuffle %s, %s [{', '.join([str(a)] * 16 + [str(a + 1)] * 16)}] : vector<16xf32>, vector<16xf32>",
                f"%v{t} = arith.mulf %f{t}, %sv{t} : {acc}",
                block.accumulate(f"%v{t}", 128 * h + 32 * g, f"g{t}"),
            ]
    return "\n".join(lines)


def function_name(m: int, n: int, k: int, elem: str) -> str:
    return KERNEL.function_name(m, n, k, elem)


def module_asm(m: int, n: int, k: int, elem: str) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>, blocks:
    tensor<n x k/256 x 210 x i8>) -> tensor<m x n x elem>`` and the dispatch it calls."""
    return dispatch.module_asm(KERNEL, m, n, k, elem, _body)
