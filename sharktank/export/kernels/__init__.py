"""Hand-written CPU dispatches for products with quantized weights (export for ``cpu``).

:func:`block_product` is the kernel :func:`sharktank.ops.block_kernels` takes: a traced
``x @ w.T`` with a Q8_0, Q4_K or Q6_K weight becomes one call of that layout's dispatch
(:mod:`.q8_0`, :mod:`.q4_k`, :mod:`.q6_k`, in the frame of :mod:`.dispatch`); other layouts
(and activation dtypes other than float32, bfloat16, float16) return None and keep the torch
form. Imports iree-turbine (the custom op), so only export imports it.
"""

from __future__ import annotations

import re

import torch

from ...types import QuantizedTensor

__all__ = ["block_product", "kernels_in", "LAYOUTS"]

LAYOUTS = ("Q8_0", "Q4_K", "Q6_K")  # the block layouts that have a kernel
_KERNEL_CALL = re.compile(r"@sharktank_(\w+?)_product_\d")


def block_product(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor | None:
    """``x @ w.T`` (``x`` ``[..., K]``, ``w`` quantized ``[N, K]``) as a kernel call, or None
    where there is no kernel for ``w``'s layout, ``x``'s dtype or the shape (a generator
    refuses one whose scratch would not fit a dispatch's stack)."""
    from .custom_op import ELEMENT_TYPES, GENERATORS, PRODUCTS

    if w.layout.name not in LAYOUTS or x.dtype not in ELEMENT_TYPES:
        return None
    n, k = w.shape
    try:
        GENERATORS[w.layout.name].module_asm(x.numel() // k, n, k, "f32")
    except ValueError:
        return None
    # float32 x: LLVM widens bfloat16 lanes one at a time, and each weight row reads x again
    # (an 8192x2048 Q8_0 product: 1.0 ms with bfloat16 x, 0.55-0.6 ms with float32 x). The
    # conversions are elementwise on x and y, which IREE fuses into their neighbours.
    y = PRODUCTS[w.layout.name](x.reshape(-1, k).float(), w.blocks.view(torch.int8))
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def kernels_in(mlir: str) -> list[str]:
    """The block layouts whose kernels an exported module calls (lower case, e.g. ``q8_0``)."""
    return sorted(set(_KERNEL_CALL.findall(mlir)))
