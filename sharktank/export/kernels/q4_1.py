"""The Q4_1 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
20-byte block of 32 values, ``d`` and ``m`` (float16) and 16 bytes of 4-bit ``q``; ``x = d *
q + m``, two blocks a step with int16 x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import block_values, legacy_kernel, nibble_pair, pair_product, pair_scales
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    d, m = pair_scales(blk, 2)
    pair_product(blk, nibble_pair(blk, 4), d, m)


KERNEL = legacy_kernel("Q4_1", _body, lambda blk: block_values(blk, 4))
