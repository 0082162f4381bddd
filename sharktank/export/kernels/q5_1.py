"""The Q5_1 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
24-byte block of 32 values, ``d`` and ``m`` (float16), 4 bytes of fifth bits and 16 bytes of
low 4 bits; ``x = d * q + m``, two blocks a step with int16 x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import block_values, fifth_bit_pair, legacy_kernel, nibble_pair, pair_product, pair_scales
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    d, m = pair_scales(blk, 2)
    q = blk.e.binary("arith.ori", nibble_pair(blk, 8), fifth_bit_pair(blk, 4), "q")
    pair_product(blk, q, d, m)


KERNEL = legacy_kernel("Q5_1", _body, lambda blk: block_values(blk, 8, 4))
