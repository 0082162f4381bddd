"""Plain bfloat16 weights (a bfloat16 model's) in the hand-written products, on a CPU without
AVX512-BF16 only (:func:`~sharktank.export.kernels.kernel_of`): the same kernels as float16
weights' (:mod:`.f16`: a decode step's values widened to float32 and multiplied with float32
x, a prompt's in the prefill dispatch, whose bfloat16 tile then holds them exactly).

Why: such a CPU (AVX2 only: AMD Zen 2/3, Intel client parts) has no bfloat16 arithmetic, and
IREE 3.10's llvm-cpu code for a bfloat16 product there widens value by value: a 128x1536x576
product took 190-220 ms against 4.3 ms in float32 and 3.3-4.2 ms in the prefill dispatch
(``tools/bench_products.py`` on an AVX2-only EPYC, 2026-12-06). With AVX512-BF16, IREE's own
bfloat16 products are fast and stay.

Numerics: the weight's values are exact in both kernels; x is widened to float32 (decode) or
kept in bfloat16 (a prompt), the sums float32: a bfloat16 model's products as torch computes
them, up to summation order.
"""

from __future__ import annotations

from .block_kernel import BlockKernel
from .f16 import VALUES, body, values

__all__ = ["KERNEL"]

KERNEL = BlockKernel("BF16", body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,), values=values, weight="bf16", plain_block=VALUES)
