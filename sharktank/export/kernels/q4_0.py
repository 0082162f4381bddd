"""The Q4_0 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
18-byte block of 32 values, ``d`` (float16) and 16 bytes of 4-bit ``q``; ``x = d * (q - 8)``,
two blocks a step with int16 x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import block_values, legacy_kernel, nibble_pair, pair_product, pair_scales
from .mlir import vector
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    e = blk.e
    (d,) = pair_scales(blk, 1)
    pair_product(blk, nibble_pair(blk, 2), d, e.binary("arith.mulf", d, e.const(-8.0, vector(2, "f32")), "m"))


KERNEL = legacy_kernel("Q4_0", _body, lambda blk: block_values(blk, 2, zero=8))
