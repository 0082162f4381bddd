"""The hand-written block-product dispatches as iree-turbine custom ops.

Traced, an op becomes a call of the kernel's ``util.func`` (merged into the exported module
with its ``stream.executable``); eagerly it is the torch block product it replaces, so a
model with kernels enabled computes the same eagerly as without them.
"""

from __future__ import annotations

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, impl_helper
from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader

from ...types.quantized import LAYOUTS, QuantizedTensor
from . import q8_0

ELEMENT_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class _Generated(TemplateLoader):
    """Templates that are Python functions of the kernel's shape (see :mod:`.q8_0`)."""

    def load_template(self, kb: KernelBuilder, name: str, **kwargs):
        return self._parse_module_asm(kb, q8_0.module_asm(**kwargs))


_templates = _Generated()


@CustomOp.register()
class sharktank_q8_0_product(CustomOp):
    """``x [M, K] @ dequantize(blocks).T`` for Q8_0 ``blocks`` ``[N, K/32, 34]`` (int8 view)."""

    signature = "sharktank_q8_0_product(Tensor x, Tensor blocks) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        x, blocks = ksel.arg_tensor(0), ksel.arg_tensor(1)
        torch._check(x.t.ndim == 2 and blocks.t.ndim == 3, lambda: f"Q8_0 kernel: expected x [M, K] and blocks [N, K/32, 34], found {list(x.t.shape)} and {list(blocks.t.shape)}")
        x.specialize_all_dims()
        blocks.specialize_all_dims()
        out = ksel.return_new_tensor([x.t.shape[0], blocks.t.shape[0]], x.t.dtype)
        out.specialize_all_dims()

    def eager_execute(self, x, blocks):
        n, nb, _ = blocks.shape
        w = QuantizedTensor(LAYOUTS["Q8_0"], (n, nb * 32), blocks.view(torch.uint8))
        return w.product(x)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, blocks = ksel.arg_descs[0].t, ksel.arg_descs[1].t
        m, k, n = x.shape[0], x.shape[1], blocks.shape[0]
        elem = ELEMENT_TYPES[x.dtype]
        name = q8_0.function_name(m, n, k, elem)
        func = _templates.inline_template_function(kb, "q8_0", name, m=m, n=n, k=k, elem=elem)
        kb.yield_results(*impl_helper.call_function(func, *kb.arg_bindings))
