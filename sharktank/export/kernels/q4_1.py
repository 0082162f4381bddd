"""The Q4_1 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
20-byte block of 32 values, ``d`` and ``m`` (float16) and 16 bytes of 4-bit ``q``; ``x = d *
q + m``, formed in float32 and multiplied with float x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import affine_product, nibbles
from .block_kernel import BlockKernel
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    q = nibbles(blk, 4)
    d, m = blk.halves(0, 2)
    affine_product(blk, q, False, d, m)


KERNEL = BlockKernel("Q4_1", _body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,))
