"""The Q8_0 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch.

IREE 3.10's llvm-cpu code for the same product written in torch (``QuantizedTensor.product``)
is compute-bound: an 8192x2048 matvec took 1.2-1.4 ms (13-15 GB/s of block bytes), slower
than the bfloat16 product it should beat by reading half the bytes. This dispatch walks the
blocks as stored: per weight row, per 34-byte block, it loads the 32 int8 values and the
float16 scale, forms the 32 values once (``d * q``, in float32) and adds their products with
each row of ``x`` into per-row float32 accumulators of 32 lanes, summed at the row's end. The
same matvec takes 0.55-0.71 ms (about the machine's read bandwidth); with 8 rows of ``x``,
3.2-4.4 ms (FP-bound; bf16 dense 1.2-1.6 ms, the torch form 8.3-9.1 ms). Workgroups take
:data:`KERNEL`'s ``rows_per_workgroup`` weight rows each (the frame: :mod:`.product_dispatch`).

The MLIR is plain ``scf``/``vector``/``memref`` inside a ``stream.executable`` (no external
object, no toolchain): IREE's CPU backend lowers it for the host like its own kernels. It is
a CPU dispatch only (a GPU would run it on one thread).
"""

from __future__ import annotations

from .block_kernel import BlockKernel
from .mlir import Value, vector
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    e = blk.e
    q = blk.byte(2, 32)
    qf = e.cast("arith.sitofp", q, blk.acc, "qf")
    (d,) = blk.halves(0)
    values = e.binary("arith.mulf", qf, e.broadcast(d, blk.acc, "d"), "wv")
    blk.accumulate(values, 0)


def _values(blk: Block) -> list[tuple[int, Value]]:
    e = blk.e
    (d,) = blk.halves(0)
    qf = e.cast("arith.sitofp", blk.byte(2, 32), vector(32, "f32"), "qf")
    return [(0, e.binary("arith.mulf", qf, e.broadcast(d, vector(32, "f32"), "d"), "wv"))]


KERNEL = BlockKernel("Q8_0", _body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,), values=_values)
