"""The block layouts that have a CPU kernel: one entry per layout file. Everything else about
the kernels is derived from this table: the custom ops (:mod:`.custom_op`), which layouts
:func:`~sharktank.export.kernels.block_product` takes and whether a shape fits
(:meth:`.BlockKernel.refusal`), and the manifest's ``cpu_kernels``
(:func:`~sharktank.export.kernels.kernels_in`); and :data:`PREFILLS`, the weights a prompt's
product reads in the prefill dispatch (:mod:`.prefill`): each kernel's that says its values.
Besides the quantized layouts, plain float16 weights have a kernel (``F16``, :mod:`.f16`), and
so do bfloat16 ones (``BF16``, :mod:`.bf16`) and a mixture of experts' stacked float32 experts
(``F32``, :mod:`.f32`, which has no prefill form).

Adding a layout: a file with its loop body and its :class:`.BlockKernel`, and its line here.
"""

from __future__ import annotations

from . import bf16, f16, f32, q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0
from .block_kernel import BlockKernel
from .prefill import PrefillWeights

__all__ = ["KERNELS", "LAYOUTS", "PREFILLS"]


def _table(*kernels: BlockKernel) -> dict[str, BlockKernel]:
    table = {kernel.layout_name: kernel for kernel in kernels}
    if len(table) != len(kernels):
        raise ValueError(f"one kernel per layout expected, found {[k.layout_name for k in kernels]}")
    return table


KERNELS: dict[str, BlockKernel] = _table(
    q8_0.KERNEL,
    q4_0.KERNEL,
    q4_1.KERNEL,
    q5_0.KERNEL,
    q5_1.KERNEL,
    q4_k.KERNEL,
    q5_k.KERNEL,
    q6_k.KERNEL,
    q3_k.KERNEL,
    f16.KERNEL,
    bf16.KERNEL,
    f32.KERNEL,
)
LAYOUTS = tuple(name for name, kernel in KERNELS.items() if not kernel.plain)  # the block layouts that have a kernel
# The prefill dispatch's weights by KERNELS's keys ("Q4_K"; "F16" for plain float16 weights;
# every kernel's but F32's).
PREFILLS: dict[str, PrefillWeights] = {name: kernel.prefill for name, kernel in KERNELS.items() if kernel.prefill is not None}
