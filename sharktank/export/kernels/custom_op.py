"""The hand-written dispatches as iree-turbine custom ops: a block product per layout, x's
int16 rounding per int16-x layout, and decode attention.

Traced, an op becomes a call of the kernel's ``util.func`` (merged into the exported module
with its ``stream.executable``); eagerly it is the torch form it replaces, so a model with
kernels enabled computes the same eagerly as without them.
"""

from __future__ import annotations

from types import ModuleType

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, impl_helper
from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader

from ...types.quantized import LAYOUTS, QuantizedTensor
from . import attention, int16_x, q4_k, q6_k, q8_0

__all__ = ["ELEMENT_TYPES", "GENERATORS", "PRODUCTS", "ROUNDINGS", "sharktank_decode_attention"]

ELEMENT_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
DTYPES = {name: dtype for dtype, name in ELEMENT_TYPES.items()}
GENERATORS: dict[str, ModuleType] = {"Q8_0": q8_0, "Q4_K": q4_k, "Q6_K": q6_k}  # layout -> its MLIR generator


class _Generated(TemplateLoader):
    """Templates that are Python functions (``module``, a generator's ``module_asm``) of a
    kernel's shape."""

    def load_template(self, kb: KernelBuilder, name: str, *, module, **kwargs):
        return self._parse_module_asm(kb, module(**kwargs))


_templates = _Generated()


class _BlockProduct(CustomOp):
    """``x [M, K] @ dequantize(blocks).T`` for ``layout`` ``blocks`` ``[N, K/block_size,
    block_bytes]`` (an int8 view of the stored bytes), in dtype ``y`` ("f32", "bf16", "f16")."""

    layout: str

    def _result(self, ksel: KernelSelection, m: int, n: int, y_at: int) -> None:
        y = ksel.attr_str(y_at).v
        torch._check(y in DTYPES, lambda: f"{self.layout} kernel: result type {y!r} is not one of {sorted(DTYPES)}")
        ksel.return_new_tensor([m, n], DTYPES[y]).specialize_all_dims()

    def select(self, ksel: KernelSelection):
        x, blocks = ksel.arg_tensor(0), ksel.arg_tensor(1)
        lay = LAYOUTS[self.layout]
        torch._check(
            x.t.ndim == 2 and blocks.t.ndim == 3 and blocks.t.shape[-1] == lay.block_bytes and x.t.shape[1] == blocks.t.shape[1] * lay.block_size,
            lambda: f"{self.layout} kernel: expected x [M, K] and blocks [N, K/{lay.block_size}, {lay.block_bytes}], found {list(x.t.shape)} and {list(blocks.t.shape)}",
        )
        x.specialize_all_dims()
        blocks.specialize_all_dims()
        self._result(ksel, x.t.shape[0], blocks.t.shape[0], 2)

    def eager_execute(self, x, blocks, y):
        return self._product(x, blocks).to(DTYPES[y])

    def _product(self, x, blocks):
        lay = LAYOUTS[self.layout]
        n, nb, _ = blocks.shape
        return QuantizedTensor(lay, (n, nb * lay.block_size), blocks.view(torch.uint8)).product(x)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, blocks, y = ksel.arg_descs[0].t, ksel.arg_descs[-2].t, ksel.arg_descs[-1].v
        m, k, n = x.shape[0], x.shape[1], blocks.shape[0]
        gen = GENERATORS[self.layout]
        elem, k = ("i16", k // 2) if gen.KERNEL.int16_x else (ELEMENT_TYPES[x.dtype], k)  # int16 x: two int8 planes
        name = gen.function_name(m, n, k, elem, y)
        func = _templates.inline_template_function(kb, name, name, module=gen.module_asm, m=m, n=n, k=k, elem=elem, y=y)
        tensors = [b for b in kb.arg_bindings if b is not None]  # y is an attribute, not an operand
        kb.yield_results(*impl_helper.call_function(func, *tensors))


class _Int16BlockProduct(_BlockProduct):
    """``dequantized(x) @ dequantize(blocks).T`` for int16 ``x`` as int8 ``planes`` [M, 2K]
    with its groups' ``scales`` [M, K/32] and ``sums`` [M, K/sum_group] (:mod:`.int16_x`, in
    the generator's ``X_ORDER``)."""

    def select(self, ksel: KernelSelection):
        x, scales, sums, blocks = (ksel.arg_tensor(i) for i in range(4))
        lay = LAYOUTS[self.layout]
        per = GENERATORS[self.layout].KERNEL.sum_group
        groups = [x.t.shape[0], x.t.shape[1] // (2 * int16_x.GROUP)] if x.t.ndim == 2 else None
        summed = [x.t.shape[0], x.t.shape[1] // (2 * per)] if x.t.ndim == 2 else None
        torch._check(
            x.t.ndim == 2 and x.t.dtype == torch.int8 and list(scales.t.shape) == groups and list(sums.t.shape) == summed
            and blocks.t.ndim == 3 and blocks.t.shape[-1] == lay.block_bytes and x.t.shape[1] == 2 * blocks.t.shape[1] * lay.block_size,
            lambda: f"{self.layout} kernel: expected int8 planes [M, 2K], scales [M, K/{int16_x.GROUP}], sums [M, K/{per}] and blocks [N, K/{lay.block_size}, {lay.block_bytes}], "
            f"found {list(x.t.shape)} ({x.t.dtype}), {list(scales.t.shape)}, {list(sums.t.shape)} and {list(blocks.t.shape)}",
        )
        for arg in (x, scales, sums, blocks):
            arg.specialize_all_dims()
        self._result(ksel, x.t.shape[0], blocks.t.shape[0], 4)

    def eager_execute(self, x, scales, sums, blocks, y):
        return self._product(int16_x.dequantized(x, scales, GENERATORS[self.layout].X_ORDER), blocks).to(DTYPES[y])


class _Int16X(CustomOp):
    """``int16_x.quantize(x, X_ORDER, sum_group)`` for ``layout``'s kernel: ``(planes, scales,
    sums)`` of float ``x`` [M, K], as one dispatch (:func:`.int16_x.module_asm`)."""

    layout: str

    def select(self, ksel: KernelSelection):
        x = ksel.arg_tensor(0)
        torch._check(
            x.t.ndim == 2 and x.t.shape[1] % int16_x.PLANE == 0 and x.t.dtype in ELEMENT_TYPES,
            lambda: f"int16 x: expected float x [M, K] with K a multiple of {int16_x.PLANE}, found {list(x.t.shape)} ({x.t.dtype})",
        )
        x.specialize_all_dims()
        (m, k), per = x.t.shape, GENERATORS[self.layout].KERNEL.sum_group
        for shape, dtype in (([m, 2 * k], torch.int8), ([m, k // int16_x.GROUP], torch.float32), ([m, k // per], torch.float32)):
            ksel.return_new_tensor(shape, dtype).specialize_all_dims()

    def eager_execute(self, x):
        gen = GENERATORS[self.layout]
        return int16_x.quantize(x, gen.X_ORDER, gen.KERNEL.sum_group)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, gen = ksel.arg_descs[0].t, GENERATORS[self.layout]
        args = dict(m=x.shape[0], k=x.shape[1], elem=ELEMENT_TYPES[x.dtype], order=gen.X_ORDER, sum_group=gen.KERNEL.sum_group)
        name = int16_x.function_name(**args)
        func = _templates.inline_template_function(kb, name, name, module=int16_x.module_asm, **args)
        kb.yield_results(*impl_helper.call_function(func, *kb.arg_bindings))


@CustomOp.register()
class sharktank_q4_k_x16(_Int16X):
    signature = "sharktank_q4_k_x16(Tensor x) -> (Tensor, Tensor, Tensor)"
    layout = "Q4_K"


@CustomOp.register()
class sharktank_q6_k_x16(_Int16X):
    signature = "sharktank_q6_k_x16(Tensor x) -> (Tensor, Tensor, Tensor)"
    layout = "Q6_K"


@CustomOp.register()
class sharktank_q8_0_product(_BlockProduct):
    signature = "sharktank_q8_0_product(Tensor x, Tensor blocks, str y) -> (Tensor)"
    layout = "Q8_0"


@CustomOp.register()
class sharktank_q4_k_product(_Int16BlockProduct):
    signature = "sharktank_q4_k_product(Tensor x, Tensor scales, Tensor sums, Tensor blocks, str y) -> (Tensor)"
    layout = "Q4_K"


@CustomOp.register()
class sharktank_q6_k_product(_Int16BlockProduct):
    signature = "sharktank_q6_k_product(Tensor x, Tensor scales, Tensor sums, Tensor blocks, str y) -> (Tensor)"
    layout = "Q6_K"


# The op of each layout with a kernel: ``op(x, blocks.view(torch.int8), y)``, or for a layout
# whose generator takes int16 x, ``op(*ROUNDINGS[layout](x), blocks.view(torch.int8), y)``;
# ``y``: the result's element type ("f32", "bf16", "f16").
PRODUCTS = {"Q8_0": sharktank_q8_0_product, "Q4_K": sharktank_q4_k_product, "Q6_K": sharktank_q6_k_product}
ROUNDINGS = {"Q4_K": sharktank_q4_k_x16, "Q6_K": sharktank_q6_k_x16}  # x as its int16 kernel takes it


@CustomOp.register()
class sharktank_decode_attention(CustomOp):
    """``softmax(scale * q . k, where mask) @ v`` for ``q`` [B, H, E] (one query per sequence
    and head) over a cache ``k``, ``v`` [B, T, KVH, E] (as stored; H a multiple of KVH, query
    head i taking KV head i // (H / KVH)) and ``mask`` [B, T] (int8: 0 = not attended), in
    float32; the result [B, H, E] in q's dtype (:mod:`.attention`). What a masked entry
    holds never reaches the result, not even a NaN (torch's softmax-then-product would
    multiply it by 0)."""

    signature = "sharktank_decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        q, k, v, mask = (ksel.arg_tensor(i) for i in range(4))
        ksel.attr_float(4)
        qs, ks = list(q.t.shape), list(k.t.shape)
        torch._check(
            len(qs) == 3 and len(ks) == 4 and list(v.t.shape) == ks and v.t.dtype == k.t.dtype and ks[0] == qs[0] and ks[3] == qs[2]
            and qs[1] % ks[2] == 0 and ks[1] % attention.CHUNK == 0 and list(mask.t.shape) == ks[:2] and mask.t.dtype == torch.int8
            and q.t.dtype in ELEMENT_TYPES and k.t.dtype in ELEMENT_TYPES,
            lambda: f"decode attention: expected q [B, H, E], k and v [B, T, KVH, E] (H a multiple of KVH, T of {attention.CHUNK}) and an int8 mask [B, T], "
            f"found {qs} ({q.t.dtype}), {ks} ({k.t.dtype}), {list(v.t.shape)} ({v.t.dtype}) and {list(mask.t.shape)} ({mask.t.dtype})",
        )
        for arg in (q, k, v, mask):
            arg.specialize_all_dims()
        ksel.return_new_tensor(qs, q.t.dtype).specialize_all_dims()

    def eager_execute(self, q, k, v, mask, scale):
        b, h, e = q.shape
        kvh = k.shape[2]
        dropped = (mask == 0)[:, :, None, None]  # entries not read (whatever they hold)
        k, v = k.float().masked_fill(dropped, 0), v.float().masked_fill(dropped, 0)
        s = torch.einsum("bkge,btke->bkgt", q.float().reshape(b, kvh, h // kvh, e), k) * scale
        p = torch.softmax(s.masked_fill(mask[:, None, None, :] == 0, float("-inf")), -1)
        return torch.einsum("bkgt,btke->bkge", p, v).reshape(b, h, e).to(q.dtype)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        q, k = ksel.arg_descs[0].t, ksel.arg_descs[1].t
        (b, h, e), (_, t, kvh, _) = q.shape, k.shape
        args = dict(b=b, h=h, t=t, kvh=kvh, e=e, q_elem=ELEMENT_TYPES[q.dtype], kv_elem=ELEMENT_TYPES[k.dtype], scale=ksel.arg_descs[4].v)
        name = attention.function_name(**args)
        func = _templates.inline_template_function(kb, name, name, module=attention.module_asm, **args)
        tensors = [a for a in kb.arg_bindings if a is not None]  # the scale is an attribute
        kb.yield_results(*impl_helper.call_function(func, *tensors))
