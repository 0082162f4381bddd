"""The Q5_0 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
22-byte block of 32 values, ``d`` (float16), 4 bytes of fifth bits and 16 bytes of low 4
bits; ``x = d * (q - 16)``, formed in float32 and multiplied with float x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import affine_product, fifth_bits, nibbles
from .block_kernel import BlockKernel
from .mlir import vector
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    e = blk.e
    q = e.binary("arith.ori", nibbles(blk, 6), fifth_bits(blk, 2), "q")
    q = e.binary("arith.subi", q, e.const(16, vector(32, "i8")), "q")
    (d,) = blk.halves(0)
    affine_product(blk, q, True, d)


KERNEL = BlockKernel("Q5_0", _body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,))
