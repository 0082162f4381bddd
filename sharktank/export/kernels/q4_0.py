"""The Q4_0 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
18-byte block of 32 values, ``d`` (float16) and 16 bytes of 4-bit ``q``; ``x = d * (q - 8)``,
formed in float32 and multiplied with float x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import affine_product, nibbles
from .block_kernel import BlockKernel
from .mlir import vector
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    e = blk.e
    q = e.binary("arith.subi", nibbles(blk, 2), e.const(8, vector(32, "i8")), "q")
    (d,) = blk.halves(0)
    affine_product(blk, q, True, d)


KERNEL = BlockKernel("Q4_0", _body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,))
