"""The hand-written dispatches as iree-turbine custom ops: a block product per registered
layout (:mod:`.registry`), x's int16 rounding per int16-x layout, decode attention over a
cache or through a page table into a pool of pages (whose page count stays dynamic), and a
prompt chunk's attention through a page table (its rows dynamic too).

Traced, an op becomes a call of the kernel's ``util.func`` (merged into the exported module
with its ``stream.executable``); eagerly it is the torch form it replaces, so a model with
kernels enabled computes the same eagerly as without them. The block-product ops are made
from the registry: ``sharktank_<layout>_product`` (and ``sharktank_<layout>_x16``), and
``sharktank_<weights>_prefill`` per weight the prefill dispatch reads (``q4_k``, ``f16``).
"""

from __future__ import annotations

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, impl_helper
from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader

from ...types.quantized import QuantizedTensor
from . import attention, int16_x, prefill, product_dispatch
from .block_kernel import GROUP, BlockKernel
from .prefill import PrefillWeights
from .registry import KERNELS
from .registry import PREFILLS as PREFILL_WEIGHTS

__all__ = ["DTYPES", "ELEMENT_TYPES", "EXPERT_PRODUCTS", "PREFILLS", "PRODUCTS", "ROUNDINGS", "sharktank_decode_attention", "sharktank_paged_decode_attention", "sharktank_paged_prefill_attention"]

ELEMENT_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
DTYPES = {name: dtype for dtype, name in ELEMENT_TYPES.items()}


class _Generated(TemplateLoader):
    """Templates that are Python functions (``module``, a generator's ``module_asm``) of a
    kernel's shape."""

    def load_template(self, kb: KernelBuilder, name: str, *, module, **kwargs):
        return self._parse_module_asm(kb, module(**kwargs))


_templates = _Generated()


def _call(kb: KernelBuilder, name: str, module, **kwargs) -> None:
    """Yield the results of the generated function ``name`` on the op's tensor operands."""
    func = _templates.inline_template_function(kb, name, name, module=module, **kwargs)
    tensors = [b for b in kb.arg_bindings if b is not None]  # attributes are not operands
    kb.yield_results(*impl_helper.call_function(func, *tensors))


class _BlockProduct(CustomOp):
    """``x [M, K] @ dequantize(blocks).T`` for ``kernel``'s layout, ``blocks`` ``[N,
    K/block_size, block_bytes]`` (an int8 view of the stored bytes; for a plain weight, the
    weight [N, K] itself), in dtype ``y`` ("f32", "bf16", "f16")."""

    kernel: BlockKernel

    def _result(self, ksel: KernelSelection, m: int, n: int, y_at: int) -> None:
        y = ksel.attr_str(y_at).v
        torch._check(y in DTYPES, lambda: f"{self.kernel.layout_name} kernel: result type {y!r} is not one of {sorted(DTYPES)}")
        ksel.return_new_tensor([m, n], DTYPES[y]).specialize_all_dims()

    def select(self, ksel: KernelSelection):
        x, blocks = ksel.arg_tensor(0), ksel.arg_tensor(1)
        kern = self.kernel
        expected = f"blocks [N, K/{kern.block_size}, {kern.block_bytes}]" if not kern.plain else f"a {kern.weight} weight [N, K]"
        torch._check(
            x.t.ndim == 2 and blocks.t.ndim >= 2 and tuple(blocks.t.shape) == kern.weight_shape(blocks.t.shape[0], x.t.shape[1])
            and (not kern.plain or blocks.t.dtype == DTYPES[kern.weight]),
            lambda: f"{kern.layout_name} kernel: expected x [M, K] and {expected}, found {list(x.t.shape)} and {list(blocks.t.shape)} ({blocks.t.dtype})",
        )
        x.specialize_all_dims()
        blocks.specialize_all_dims()
        self._result(ksel, x.t.shape[0], blocks.t.shape[0], 2)

    def eager_execute(self, x, blocks, y):
        return self._product(x, blocks).to(DTYPES[y])

    def _product(self, x, blocks):
        if self.kernel.plain:  # the values as stored times float32 x, summed in float32
            return x.float() @ blocks.float().T
        n, nb, _ = blocks.shape
        return QuantizedTensor(self.kernel.layout, (n, nb * self.kernel.block_size), blocks.view(torch.uint8)).product(x)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, blocks, y = ksel.arg_descs[0].t, ksel.arg_descs[-2].t, ksel.arg_descs[-1].v
        m, k, n = x.shape[0], x.shape[1], blocks.shape[0]
        elem, k = ("i16", k // 2) if self.kernel.int16_x else (ELEMENT_TYPES[x.dtype], k)  # int16 x: two int8 planes
        args = dict(kernel=self.kernel, m=m, n=n, k=k, elem=elem, y=y)
        _call(kb, self.kernel.function_name(m, n, k, elem, y), product_dispatch.module_asm, **args)


class _Int16BlockProduct(_BlockProduct):
    """``dequantized(x) @ dequantize(blocks).T`` for int16 ``x`` as int8 ``planes`` [M, 2K]
    with its groups' ``scales`` [M, K/32] and ``sums`` [M, K/sum_group] (:mod:`.int16_x`, in
    the kernel's order)."""

    def select(self, ksel: KernelSelection):
        x, scales, sums, blocks = (ksel.arg_tensor(i) for i in range(4))
        kern, per = self.kernel, self.kernel.sum_group
        groups = [x.t.shape[0], x.t.shape[1] // (2 * GROUP)] if x.t.ndim == 2 else None
        summed = [x.t.shape[0], x.t.shape[1] // (2 * per)] if x.t.ndim == 2 else None
        torch._check(
            x.t.ndim == 2 and x.t.dtype == torch.int8 and list(scales.t.shape) == groups and list(sums.t.shape) == summed
            and blocks.t.ndim == 3 and blocks.t.shape[-1] == kern.block_bytes and x.t.shape[1] == 2 * blocks.t.shape[1] * kern.block_size,
            lambda: f"{kern.layout_name} kernel: expected int8 planes [M, 2K], scales [M, K/{GROUP}], sums [M, K/{per}] and blocks [N, K/{kern.block_size}, {kern.block_bytes}], "
            f"found {list(x.t.shape)} ({x.t.dtype}), {list(scales.t.shape)}, {list(sums.t.shape)} and {list(blocks.t.shape)}",
        )
        for arg in (x, scales, sums, blocks):
            arg.specialize_all_dims()
        self._result(ksel, x.t.shape[0], blocks.t.shape[0], 4)

    def eager_execute(self, x, scales, sums, blocks, y):
        return self._product(int16_x.dequantized(x, scales, self.kernel.int16.order, self.kernel.int16.unit), blocks).to(DTYPES[y])


class _ExpertProduct(_BlockProduct):
    """:class:`_BlockProduct` over pairs: ``x`` [P * M, K] in P pairs of M rows, pair ``p``
    times the weight of expert ``expert[p]`` (``expert``: int64 [P], in range) of the stacked
    ``blocks`` [E, ...], read in place (:func:`.product_dispatch.module_asm`'s ``experts``)."""

    def _check_expert(self, x, expert, blocks) -> None:
        kern = self.kernel
        shape = tuple(blocks.t.shape)
        k = x.t.shape[-1] // (2 if kern.int16_x else 1)
        torch._check(
            x.t.ndim == 2 and expert.t.dtype == torch.int64 and expert.t.ndim == 1 and expert.t.shape[0] >= 1
            and x.t.shape[0] % expert.t.shape[0] == 0 and len(shape) >= 3 and shape[1:] == kern.weight_shape(shape[1], k)
            and (not kern.plain or blocks.t.dtype == DTYPES[kern.weight]),
            lambda: f"{kern.layout_name} expert kernel: expected x [P * M, K], an int64 expert index per pair [P] and stacked experts "
            f"{f'[E, N, K/{kern.block_size}, {kern.block_bytes}]' if not kern.plain else f'[E, N, K] ({kern.weight})'}, "
            f"found {list(x.t.shape)}, {list(expert.t.shape)} ({expert.t.dtype}) and {list(shape)} ({blocks.t.dtype})",
        )

    def select(self, ksel: KernelSelection):
        x, expert, blocks = (ksel.arg_tensor(i) for i in range(3))
        self._check_expert(x, expert, blocks)
        for arg in (x, expert, blocks):
            arg.specialize_all_dims()
        self._result(ksel, x.t.shape[0], blocks.t.shape[1], 3)

    def _pairs(self, x, expert, blocks, y):
        m = x.shape[0] // expert.shape[0]
        return torch.cat([self._product(x[p * m : (p + 1) * m], blocks[e]) for p, e in enumerate(expert.tolist())]).to(DTYPES[y])

    def eager_execute(self, x, expert, blocks, y):
        return self._pairs(x, expert, blocks, y)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, expert, blocks, y = ksel.arg_descs[0].t, ksel.arg_descs[-3].t, ksel.arg_descs[-2].t, ksel.arg_descs[-1].v
        pairs, experts, n = expert.shape[0], blocks.shape[0], blocks.shape[1]
        m, k = x.shape[0] // pairs, x.shape[1]
        elem, k = ("i16", k // 2) if self.kernel.int16_x else (ELEMENT_TYPES[x.dtype], k)
        args = dict(kernel=self.kernel, m=m, n=n, k=k, elem=elem, y=y, experts=experts, pairs=pairs)
        _call(kb, self.kernel.function_name(m, n, k, elem, y, experts, pairs), product_dispatch.module_asm, **args)


class _Int16ExpertProduct(_ExpertProduct):
    """:class:`_Int16BlockProduct` over pairs, as :class:`_ExpertProduct`: int16 ``x`` as
    int8 planes [P * M, 2K] with its ``scales`` and ``sums``, the stacked ``blocks`` [E, N,
    K/block_size, block_bytes]."""

    def select(self, ksel: KernelSelection):
        x, scales, sums, expert, blocks = (ksel.arg_tensor(i) for i in range(5))
        self._check_expert(x, expert, blocks)
        kern, per = self.kernel, self.kernel.sum_group
        torch._check(
            x.t.dtype == torch.int8 and list(scales.t.shape) == [x.t.shape[0], x.t.shape[1] // (2 * GROUP)]
            and list(sums.t.shape) == [x.t.shape[0], x.t.shape[1] // (2 * per)],
            lambda: f"{kern.layout_name} expert kernel: expected int8 planes [P * M, 2K], scales [P * M, K/{GROUP}] and sums [P * M, K/{per}], "
            f"found {list(x.t.shape)} ({x.t.dtype}), {list(scales.t.shape)} and {list(sums.t.shape)}",
        )
        for arg in (x, scales, sums, expert, blocks):
            arg.specialize_all_dims()
        self._result(ksel, x.t.shape[0], blocks.t.shape[1], 5)

    def eager_execute(self, x, scales, sums, expert, blocks, y):
        x = int16_x.dequantized(x, scales, self.kernel.int16.order, self.kernel.int16.unit)
        return self._pairs(x, expert, blocks, y)


class _PrefillProduct(CustomOp):
    """A prompt's product (:mod:`.prefill`): bfloat16 ``x`` [M, K] times the weight read as
    ``weights`` from its blocks [N, K/block_size, block_bytes] (int8; a plain weight: itself,
    [N, K]), as float32 [M, N]; M stays dynamic. Eagerly: the weight's values rounded to bfloat16 as the tile holds them."""

    weights: PrefillWeights

    def select(self, ksel: KernelSelection):
        x, blocks = ksel.arg_tensor(0), ksel.arg_tensor(1)
        kern = self.weights
        dtype = DTYPES.get(kern.elem, torch.int8)
        expected = f"[N, K/{kern.block_size}, {kern.block_bytes}] {dtype}" if kern.elem == "i8" else f"[N, K] {dtype}"
        torch._check(
            x.t.ndim == 2 and x.t.dtype == torch.bfloat16 and blocks.t.ndim >= 2 and blocks.t.dtype == dtype
            and tuple(blocks.t.shape) == kern.weight_shape(blocks.t.shape[0], x.t.shape[1]),
            lambda: f"{kern.what} prefill kernel: expected bfloat16 x [M, K] and weights {expected}, "
            f"found {list(x.t.shape)} ({x.t.dtype}) and {list(blocks.t.shape)} ({blocks.t.dtype})",
        )
        x.specialize_dims(1)  # the rows stay dynamic
        blocks.specialize_all_dims()
        ksel.return_new_tensor([x.t.shape[0], blocks.t.shape[0]], torch.float32).specialize_dims(1)

    def eager_execute(self, x, blocks):
        return x.float() @ self.weights.dense(blocks).to(torch.bfloat16).float().T

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, blocks = ksel.arg_descs[0].t, ksel.arg_descs[1].t
        n, k = blocks.shape[0], x.shape[1]
        _call(kb, prefill.function_name(self.weights, n, k), prefill.module_asm, kernel=self.weights, n=n, k=k)


class _Int16X(CustomOp):
    """``int16_x.quantize(x, order, sum_group, unit)`` for ``kernel``: ``(planes, scales, sums)`` of
    float ``x`` [M, K], as one dispatch (:func:`.int16_x.module_asm`)."""

    kernel: BlockKernel

    def select(self, ksel: KernelSelection):
        x = ksel.arg_tensor(0)
        torch._check(
            x.t.ndim == 2 and x.t.shape[1] % self.kernel.int16.plane == 0 and x.t.dtype in ELEMENT_TYPES,
            lambda: f"int16 x: expected float x [M, K] with K a multiple of {self.kernel.int16.plane}, found {list(x.t.shape)} ({x.t.dtype})",
        )
        x.specialize_all_dims()
        (m, k), per = x.t.shape, self.kernel.sum_group
        for shape, dtype in (([m, 2 * k], torch.int8), ([m, k // GROUP], torch.float32), ([m, k // per], torch.float32)):
            ksel.return_new_tensor(shape, dtype).specialize_all_dims()

    def eager_execute(self, x):
        return int16_x.quantize(x, self.kernel.int16.order, self.kernel.sum_group, self.kernel.int16.unit)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x = ksel.arg_descs[0].t
        args = dict(m=x.shape[0], k=x.shape[1], elem=ELEMENT_TYPES[x.dtype], order=self.kernel.int16.order, sum_group=self.kernel.sum_group, unit=self.kernel.int16.unit)
        _call(kb, int16_x.function_name(**args), int16_x.module_asm, **args)


def _register(base: type, name: str, operands: str, results: str, kernel: BlockKernel):
    """The op ``name(operands) -> results`` of class ``base`` for ``kernel``, registered."""
    body = {"signature": f"{name}({operands}) -> {results}", "kernel": kernel, "__doc__": base.__doc__}
    return CustomOp.register()(type(name, (base,), body))


def _product_op(kernel: BlockKernel):
    if kernel.int16_x:
        return _register(_Int16BlockProduct, f"sharktank_{kernel.name}_product", "Tensor x, Tensor scales, Tensor sums, Tensor blocks, str y", "(Tensor)", kernel)
    return _register(_BlockProduct, f"sharktank_{kernel.name}_product", "Tensor x, Tensor blocks, str y", "(Tensor)", kernel)


def _expert_product_op(kernel: BlockKernel):
    name = f"sharktank_{kernel.name}_expert_product"
    if kernel.int16_x:
        return _register(_Int16ExpertProduct, name, "Tensor x, Tensor scales, Tensor sums, Tensor expert, Tensor blocks, str y", "(Tensor)", kernel)
    return _register(_ExpertProduct, name, "Tensor x, Tensor expert, Tensor blocks, str y", "(Tensor)", kernel)


# The op of each layout with a kernel: ``op(x, blocks.view(torch.int8), y)``, or for a layout
# whose kernel takes int16 x, ``op(*ROUNDINGS[layout](x), blocks.view(torch.int8), y)``;
# ``y``: the result's element type ("f32", "bf16", "f16").
PRODUCTS = {layout: _product_op(kernel) for layout, kernel in KERNELS.items()}
# The same over pairs of rows and experts of stacked weights: ``op(x, expert, stacked, y)``
# (int16 x: ``op(*rounding, expert, stacked, y)``), ``expert`` an int64 [P] index into
# ``stacked`` [E, ...] per pair, x [P * M, K].
EXPERT_PRODUCTS = {layout: _expert_product_op(kernel) for layout, kernel in KERNELS.items()}
PREFILLS = {  # the prompt products: op(x in bfloat16, blocks [N, K/bs, bb] int8 or a plain weight), by registry.PREFILLS's keys
    what: CustomOp.register()(
        type(f"sharktank_{weights.name}_prefill", (_PrefillProduct,), {
            "signature": f"sharktank_{weights.name}_prefill(Tensor x, Tensor blocks) -> (Tensor)", "weights": weights, "__doc__": _PrefillProduct.__doc__,
        })
    )
    for what, weights in PREFILL_WEIGHTS.items()
}
ROUNDINGS = {  # x as its int16 kernel takes it
    layout: _register(_Int16X, f"sharktank_{kernel.name}_x16", "Tensor x", "(Tensor, Tensor, Tensor)", kernel)
    for layout, kernel in KERNELS.items()
    if kernel.int16_x
}


def _attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """The decode-attention ops' eager form: q [B, H, E] over k, v [B, T, KVH, E] where the
    int8 mask [B, T] is not 0, in float32."""
    b, h, e = q.shape
    kvh = k.shape[2]
    dropped = (mask == 0)[:, :, None, None]  # entries not read (whatever they hold)
    k, v = k.float().masked_fill(dropped, 0), v.float().masked_fill(dropped, 0)
    s = torch.einsum("bkge,btke->bkgt", q.float().reshape(b, kvh, h // kvh, e), k) * scale
    p = torch.softmax(s.masked_fill(mask[:, None, None, :] == 0, float("-inf")), -1)
    return torch.einsum("bkgt,btke->bkge", p, v).reshape(b, h, e).to(q.dtype)


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
        return _attention(q, k, v, mask, scale)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        q, k = ksel.arg_descs[0].t, ksel.arg_descs[1].t
        (b, h, e), (_, t, kvh, _) = q.shape, k.shape
        args = dict(b=b, h=h, t=t, kvh=kvh, e=e, q_elem=ELEMENT_TYPES[q.dtype], kv_elem=ELEMENT_TYPES[k.dtype], scale=ksel.arg_descs[4].v)
        _call(kb, attention.function_name(**args), attention.module_asm, **args)


@CustomOp.register()
class sharktank_paged_decode_attention(CustomOp):
    """:class:`sharktank_decode_attention` over each sequence's pages: ``q`` [B, H, E], pools
    ``k_pool``, ``v_pool`` [P, N, KVH, E] (P pages of N entries; P stays dynamic when traced),
    ``pages`` [B, M] (int64: entry t of sequence b is slot t % N of page pages[b, t // N]) and
    ``mask`` [B, M * N] (int8), M * N a multiple of ``attention.CHUNK``; the result [B, H, E]
    in q's dtype (:func:`.attention.paged_module_asm`). Eagerly: the pages gathered, then
    that op's attention."""

    signature = "sharktank_paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor pages, Tensor mask, float scale) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        q, k, v, pages, mask = (ksel.arg_tensor(i) for i in range(5))
        ksel.attr_float(5)
        qs, ks, vs, ps = list(q.t.shape), list(k.t.shape), list(v.t.shape), list(pages.t.shape)
        torch._check(
            len(qs) == 3 and len(ks) == 4 and len(vs) == 4 and vs[1:] == ks[1:] and v.t.dtype == k.t.dtype and ks[3] == qs[2] and qs[1] % ks[2] == 0
            and len(ps) == 2 and ps[0] == qs[0] and pages.t.dtype == torch.int64 and list(mask.t.shape) == [qs[0], ps[1] * ks[1]] and mask.t.dtype == torch.int8
            and ps[1] * ks[1] % attention.CHUNK == 0 and q.t.dtype in ELEMENT_TYPES and k.t.dtype in ELEMENT_TYPES,
            lambda: f"paged decode attention: expected q [B, H, E], pools [P, N, KVH, E] (H a multiple of KVH), int64 pages [B, M] and an int8 mask [B, M * N] "
            f"(M * N a multiple of {attention.CHUNK}), found {qs} ({q.t.dtype}), {ks} ({k.t.dtype}), {vs} ({v.t.dtype}), {ps} ({pages.t.dtype}) and {list(mask.t.shape)} ({mask.t.dtype})",
        )
        for arg in (q, pages, mask):
            arg.specialize_all_dims()
        for pool in (k, v):
            pool.specialize_dims(1, 2, 3)  # the page count stays dynamic
        ksel.return_new_tensor(qs, q.t.dtype).specialize_all_dims()

    def eager_execute(self, q, k_pool, v_pool, pages, mask, scale):
        b, m = pages.shape
        k, v = (pool[pages].reshape(b, m * pool.shape[1], *pool.shape[2:]) for pool in (k_pool, v_pool))
        return _attention(q, k, v, mask, scale)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        q, k, pages = ksel.arg_descs[0].t, ksel.arg_descs[1].t, ksel.arg_descs[3].t
        (b, h, e), (_, n, kvh, _) = q.shape, k.shape
        args = dict(b=b, h=h, m=pages.shape[1], n=n, kvh=kvh, e=e, q_elem=ELEMENT_TYPES[q.dtype], kv_elem=ELEMENT_TYPES[k.dtype], scale=ksel.arg_descs[5].v)
        _call(kb, attention.paged_function_name(**args), attention.paged_module_asm, **args)


@CustomOp.register()
class sharktank_paged_prefill_attention(CustomOp):
    """:class:`sharktank_paged_decode_attention` for R query rows: ``q`` [R, H, E] (R dynamic
    when traced, a multiple of B: rows ``s * R / B`` to ``(s + 1) * R / B - 1`` are sequence
    ``s``'s, a prompt chunk's tokens), pools ``k_pool``, ``v_pool`` [P, N, KVH, E], the page
    table transposed, ``pages`` [M, B] (int64, M dynamic: ``pages[j, s]`` is sequence ``s``'s
    ``j``-th page) and ``mask`` [R * M * N] (int8, flat: row r's M * N entries from r * M * N
    on; what each row attends, e.g. causally); the result [R, H, E] in q's dtype
    (:func:`.attention.paged_prefill_module_asm`). Eagerly: each row's pages gathered, then
    :class:`sharktank_decode_attention`'s attention."""

    signature = "sharktank_paged_prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor pages, Tensor mask, float scale) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        q, k, v, pages, mask = (ksel.arg_tensor(i) for i in range(5))
        ksel.attr_float(5)
        qs, ks, vs, ps, ms = list(q.t.shape), list(k.t.shape), list(v.t.shape), list(pages.t.shape), list(mask.t.shape)
        torch._check(
            len(qs) == 3 and len(ks) == 4 and len(vs) == 4 and vs[1:] == ks[1:] and v.t.dtype == k.t.dtype and ks[3] == qs[2] and qs[1] % ks[2] == 0
            and len(ps) == 2 and pages.t.dtype == torch.int64 and len(ms) == 1 and mask.t.dtype == torch.int8
            and q.t.dtype in ELEMENT_TYPES and k.t.dtype in ELEMENT_TYPES,
            lambda: f"paged prefill attention: expected q [R, H, E], pools [P, N, KVH, E] (H a multiple of KVH), an int64 transposed table [M, B] and "
            f"a flat int8 mask [R * M * N], found {qs} ({q.t.dtype}), {ks} ({k.t.dtype}), {vs} ({v.t.dtype}), {ps} ({pages.t.dtype}) and {ms} ({mask.t.dtype})",
        )
        q.specialize_dims(1, 2)  # the rows stay dynamic
        pages.specialize_dims(1)  # and the table's width
        mask.specialize_dims()
        for pool in (k, v):
            pool.specialize_dims(1, 2, 3)  # and the page count
        ksel.return_new_tensor(qs, q.t.dtype).specialize_dims(1, 2)

    def eager_execute(self, q, k_pool, v_pool, pages, mask, scale):
        (m, b), r = pages.shape, q.shape[0]
        t = m * k_pool.shape[1]
        if r % b or mask.numel() != r * t:
            raise ValueError(f"paged prefill attention: expected query rows a multiple of the {b} sequences and a mask of rows * {t} entries, "
                             f"found {r} rows and {mask.numel()}")
        table = pages.T.repeat_interleave(r // b, dim=0)  # each row's sequence's pages
        k, v = (pool[table].reshape(r, t, *pool.shape[2:]) for pool in (k_pool, v_pool))
        return _attention(q, k, v, mask.reshape(r, t), scale)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        q, k, pages = ksel.arg_descs[0].t, ksel.arg_descs[1].t, ksel.arg_descs[3].t
        (_, h, e), (_, n, kvh, _), b = q.shape, k.shape, pages.shape[1]
        args = dict(b=b, h=h, n=n, kvh=kvh, e=e, q_elem=ELEMENT_TYPES[q.dtype], kv_elem=ELEMENT_TYPES[k.dtype], scale=ksel.arg_descs[5].v)
        _call(kb, attention.paged_prefill_function_name(**args), attention.paged_prefill_module_asm, **args)
