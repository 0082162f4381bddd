"""The Q5_0 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch: per
22-byte block of 32 values, ``d`` (float16), 4 bytes of fifth bits and 16 bytes of low 4
bits; ``x = d * (q - 16)``, two blocks a step with int16 x (:mod:`.block32`)."""

from __future__ import annotations

from .block32 import block_values, fifth_bit_pair, legacy_kernel, nibble_pair, pair_product, pair_scales
from .mlir import vector
from .product_dispatch import Block

__all__ = ["KERNEL"]


def _body(blk: Block) -> None:
    e = blk.e
    (d,) = pair_scales(blk, 1)
    q = e.binary("arith.ori", nibble_pair(blk, 6), fifth_bit_pair(blk, 2), "q")
    pair_product(blk, q, d, e.binary("arith.mulf", d, e.const(-16.0, vector(2, "f32")), "m"))


KERNEL = legacy_kernel("Q5_0", _body, lambda blk: block_values(blk, 6, 2, zero=16))
