"""The Q8_0 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch.

IREE 3.10's llvm-cpu code for the same product written in torch (``QuantizedTensor.product``)
is compute-bound: an 8192x2048 matvec took 1.2-1.4 ms (13-15 GB/s of block bytes), slower
than the bfloat16 product it should beat by reading half the bytes. This dispatch walks the
blocks as stored: per weight row, per 34-byte block, it loads the 32 int8 values and the
float16 scale, forms the 32 values once (``d * q``, in float32) and adds their products with
each row of ``x`` into per-row float32 accumulators of 32 lanes, summed at the row's end. The
same matvec takes 0.55-0.71 ms (about the machine's read bandwidth); with 8 rows of ``x``,
3.2-4.4 ms (FP-bound; bf16 dense 1.2-1.6 ms, the torch form 8.3-9.1 ms). Workgroups take
:data:`KERNEL`'s ``rows_per_workgroup`` weight rows each (the frame: :mod:`.dispatch`).

The MLIR is plain ``scf``/``vector``/``memref`` inside a ``stream.executable`` (no external
object, no toolchain): IREE's CPU backend lowers it for the host like its own kernels. It is
a CPU dispatch only (a GPU would run it on one thread).
"""

from __future__ import annotations

from . import dispatch

KERNEL = dispatch.Kernel("q8_0", block_size=32, block_bytes=34, rows_per_workgroup=64, rows_at_once=4)
ELEMENTS = KERNEL.elements


def _body(block: dispatch.Block) -> str:
    acc = block.acc
    return f"""{block.byte(2, 32, "q")}
%qf = arith.sitofp %q : vector<32xi8> to {acc}
{block.byte(0, 2, "db")}
%dh = vector.bitcast %db : vector<2xi8> to vector<1xf16>
%df = arith.extf %dh : vector<1xf16> to vector<1xf32>
%d = vector.extract %df[0] : f32 from vector<1xf32>
%ds = vector.broadcast %d : f32 to {acc}
%wv = arith.mulf %qf, %ds : {acc}
{block.accumulate("%wv", 0, "v")}"""


def function_name(m: int, n: int, k: int, elem: str, y: str | None = None) -> str:
    return KERNEL.function_name(m, n, k, elem, y)


def module_asm(m: int, n: int, k: int, elem: str, y: str | None = None) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>, blocks:
    tensor<n x k/32 x 34 x i8>) -> tensor<m x n x y>`` and the dispatch it calls (``y``: f32, bf16 or f16, by default ``elem``)."""
    return dispatch.module_asm(KERNEL, m, n, k, elem, _body, y)
