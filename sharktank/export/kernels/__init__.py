"""Hand-written CPU dispatches for products with quantized weights (export for ``cpu``).

:func:`block_product` is the kernel :func:`sharktank.ops.block_kernels` takes: a traced
``x @ w.T`` with a Q8_0 weight becomes one call of :mod:`.q8_0`'s dispatch; other layouts
(and activation dtypes other than float32, bfloat16, float16) return None and keep the torch
form. Imports iree-turbine (the custom op), so only export imports it.
"""

from __future__ import annotations

import re

import torch

from ...types import QuantizedTensor

__all__ = ["block_product", "kernels_in", "LAYOUTS"]

LAYOUTS = ("Q8_0",)  # the block layouts that have a kernel
_KERNEL_CALL = re.compile(r"@sharktank_(\w+?)_product_\d")


def block_product(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor | None:
    """``x @ w.T`` (``x`` ``[..., K]``, ``w`` quantized ``[N, K]``) as a kernel call, or None
    where there is no kernel for ``w``'s layout or ``x``'s dtype."""
    from .custom_op import ELEMENT_TYPES, sharktank_q8_0_product

    if w.layout.name not in LAYOUTS or x.dtype not in ELEMENT_TYPES:
        return None
    n, k = w.shape
    y = sharktank_q8_0_product(x.reshape(-1, k), w.blocks.view(torch.int8))
    return y.reshape(*x.shape[:-1], n)


def kernels_in(mlir: str) -> list[str]:
    """The block layouts whose kernels an exported module calls (lower case, e.g. ``q8_0``)."""
    return sorted(set(_KERNEL_CALL.findall(mlir)))
