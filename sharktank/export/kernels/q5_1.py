"""The Q5_1 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
24-byte block of 32 values, ``d`` and ``m`` (float16), 4 bytes of fifth bits and 16 bytes of
low 4 bits; ``x = d * q + m``, formed in float32 and multiplied with float x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import affine_product, fifth_bits, nibbles
from .block_kernel import BlockKernel
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    q = blk.e.binary("arith.ori", nibbles(blk, 8), fifth_bits(blk, 4), "q")
    d, m = blk.halves(0, 2)
    affine_product(blk, q, False, d, m)


KERNEL = BlockKernel("Q5_1", _body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,))
