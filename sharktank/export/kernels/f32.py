"""Plain float32 weights in the hand-written decode products, for a mixture of experts'
stacked experts only (:func:`~sharktank.export.kernels.kernel_of` with ``stacked``): the
chosen expert's weight read in place, as the other layouts' stacked form reads it
(:func:`.product_dispatch.module_asm`'s ``experts``), 32 values a block.

Why: IREE's own product of a slice of the stacked experts at a data offset first copies the
slice into a buffer of its own (a ``slow_memcpy`` dispatch): the expert's weight is read,
written and read again. A dense float32 weight keeps IREE's product (packed for the vector
units once at load), and so does a prompt's grouped experts (whose products have many rows).

Numerics: float32 values times float32 x, summed in float32 (IREE's order differs).
"""

from __future__ import annotations

from .block_kernel import BlockKernel
from .f16 import VALUES, body

__all__ = ["KERNEL"]

KERNEL = BlockKernel("F32", body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,), weight="f32", plain_block=VALUES)
