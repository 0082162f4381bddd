"""Hand-written CPU dispatches (export for ``cpu``): products with quantized weights, a
decode step's attention over a cache (:func:`decode_attention`) or through a page table into
a pool of pages (:func:`paged_decode_attention`), and a prompt chunk's through the page table
(:func:`paged_prefill_attention`; :func:`paged_attention` picks one of the two), all
:mod:`.attention`.

:func:`block_product` is the kernel :func:`sharktank.ops.block_kernels` takes: a traced
``x @ w.T`` with a weight of a layout in :data:`.registry.KERNELS` (or a plain float16
weight: :mod:`.f16`) becomes one call of that layout's dispatch (a file per layout, e.g. :mod:`.q8_0`, in the frame of
:mod:`.product_dispatch`, itself in :mod:`.frame`, written with :mod:`.mlir`); other layouts
(and activation dtypes other than float32, bfloat16, float16) return None and keep the torch
form. The float-x kernel (Q8_0) takes x as float32; the int16-x kernels (the legacy 32-value
layouts, :mod:`.block32`, and the K-quants) take it rounded to 16-bit integers per 32 values (:mod:`.int16_x`, its error far below bfloat16's)
for exact integer dot products (AVX512-VNNI, or AVX2: :mod:`.isa`), which is what lets them
read the weights at about the machine's bandwidth. A prompt's products (more rows) take the prefill dispatch
(:func:`prefill_product`, :mod:`.prefill`) for those layouts and for plain float16 weights
(:mod:`.f16`). Imports iree-turbine (the custom op) only when a product is traced.
"""

from __future__ import annotations

import dataclasses

import torch

from ...types import QuantizedTensor
from . import isa
from .block_kernel import BlockKernel
from .registry import KERNELS, LAYOUTS

__all__ = ["block_product", "kernel_of", "prefill_product", "prefill_weights", "BlockProducts", "CpuKernels", "decode_attention", "paged_attention", "paged_decode_attention", "paged_prefill_attention", "kernels_for", "kernels_in", "KERNELS", "LAYOUTS", "INTEGER_DOT", "BF16_DOT"]

_ATTENTION_PREFIXES = {  # kernels_in's name -> the prefix of its function names (attention's)
    "decode_attention": "@sharktank_decode_attention_",
    "paged_decode_attention": "@sharktank_paged_decode_attention_",
    "paged_prefill_attention": "@sharktank_paged_prefill_attention_",
}


# The kernels are compiled for this host's CPU (the cpu target's --target-arch default), with
# the instructions it has (:mod:`.isa`): the int16-x kernels' integer dot products need
# AVX512-VNNI or AVX2, without which those layouts keep the torch form.
INTEGER_DOT = isa.HOST.int8_dot is not None
# The prefill dispatches' bfloat16 dot products (vdpbf16ps) need AVX512-BF16.
BF16_DOT = isa.HOST.bf16_dot is not None


@dataclasses.dataclass(frozen=True)
class CpuKernels:
    """An export's choice of CPU dispatches (:func:`kernels_for`). ``exact_prompts``: a prompt's
    products with quantized weights of a float32 or float16 model keep the dense product of
    the dequantized weight in x's dtype (as eager computes it) instead of the prefill
    dispatches, which round x and the weight tile to bfloat16 (:mod:`.prefill`)."""

    exact_prompts: bool = False


def kernels_for(target: str, target_arch: str | None, *, exact_prompts: bool = False) -> CpuKernels | None:
    """The kernels an export for ``target`` calls, or None: for ``cpu`` compiled for this host
    (the default ``--target-arch``), whose features the kernels are written for."""
    if target == "cpu" and (target_arch or "host") == "host":
        return CpuKernels(exact_prompts=exact_prompts)
    return None


def kernel_of(w: torch.Tensor, stacked: bool = False) -> tuple[BlockKernel, torch.Tensor] | None:
    """The kernel of ``w`` and the weight operand it takes, or None: a quantized weight of a
    layout in :data:`.registry.KERNELS` (its blocks as int8), or a plain 2-D float16 weight
    whose K divides into blocks (``F16``, :mod:`.f16`: the weight itself), or bfloat16 on a CPU
    without AVX512-BF16 (``BF16``, :mod:`.bf16`). ``stacked``: ``w`` is a mixture of experts'
    stacked weights ``[E, N, K]`` (the operand: every expert's), quantized or plain of any
    float type (float32: ``F32``, :mod:`.f32`)."""
    ndim = 3 if stacked else 2
    if isinstance(w, QuantizedTensor):
        kernel = KERNELS.get(w.layout.name)
        return None if kernel is None or len(w.shape) != ndim else (kernel, w.blocks.view(torch.int8))
    # Plain float16 weights always (no CPU here computes in float16), bfloat16 ones where the
    # CPU has no bfloat16 arithmetic (:mod:`.bf16`); stacked experts of every float type (IREE
    # copies an expert's slice before its own product reads it: :mod:`.f32`).
    if w.dtype == torch.float16:
        kernel = KERNELS["F16"]
    elif w.dtype == torch.bfloat16 and (stacked or isa.current().bf16_dot != "avx512_bf16"):
        kernel = KERNELS["BF16"]
    elif w.dtype == torch.float32 and stacked:
        kernel = KERNELS["F32"]
    else:
        return None
    return (kernel, w) if w.ndim == ndim and w.shape[-1] % kernel.block_size == 0 else None


def block_product(x: torch.Tensor, w: torch.Tensor, rounded: dict | None = None, expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ w.T`` (``x`` ``[..., K]``, ``w`` ``[N, K]`` quantized or plain float16) as a kernel
    call, or None where there is no kernel for ``w`` (:func:`kernel_of`), ``x``'s dtype or the
    shape (a generator refuses one whose scratch would not fit a dispatch's stack), or the
    host CPU lacks the instructions a kernel needs (:data:`INTEGER_DOT`, :mod:`.isa`). ``rounded``: where
    given, x's int16 rounding per (x, layout), made once and shared by the products that take
    the same x. ``expert`` (int64 indexes ``[P]``, in range): ``w`` is stacked experts ``[E,
    N, K]``, x's rows are P pairs of equally many rows, and pair ``p``'s product takes expert
    ``expert[p]``'s weight, read in place by the kernel (one dispatch for all pairs)."""
    from .custom_op import ELEMENT_TYPES, EXPERT_PRODUCTS, PRODUCTS, ROUNDINGS

    found = kernel_of(w, stacked=expert is not None)
    if found is None or x.dtype not in ELEMENT_TYPES:
        return None
    kernel, operand = found
    n, k = w.shape[-2:]
    x2 = x.reshape(-1, k)
    integer = kernel.int16_x
    if integer and isa.current().int8_dot is None:
        return None
    # The result in x's dtype, rounded as the kernel stores it: IREE made a conversion after
    # each product a dispatch of its own (7 of a 1B layer's 38).
    out = ELEMENT_TYPES[x.dtype]
    pairs = 1 if expert is None else expert.numel()
    if x2.shape[0] % pairs or kernel.refusal(x2.shape[0] // pairs, n, k, "i16" if integer else "f32", out) is not None:
        return None
    name = kernel.layout_name

    def product(*xs: torch.Tensor) -> torch.Tensor:
        if expert is None:
            return PRODUCTS[name](*xs, operand, out)
        return EXPERT_PRODUCTS[name](*xs, expert.reshape(pairs).to(torch.int64), operand, out)

    if integer:  # x as 16-bit integers per 32 values, for integer dot products (int16_x)
        if rounded is None:
            x16 = ROUNDINGS[name](x2)
        else:
            key = (id(x), name)
            if key not in rounded:
                rounded[key] = (x, ROUNDINGS[name](x2))  # holds x, so that its id stays its own
            x16 = rounded[key][1]
        y = product(*x16)
    else:
        # float32 x: LLVM widens bfloat16 lanes one at a time, and each weight row reads x
        # again (an 8192x2048 Q8_0 product: 1.0 ms with bfloat16 x, 0.55-0.6 ms with float32
        # x). The conversion is elementwise on x, which IREE fuses into its producer.
        y = product(x2.float())
    return y.reshape(*x.shape[:-1], n)


_PREFILL_X = (torch.float32, torch.bfloat16, torch.float16)


def prefill_weights(w: torch.Tensor):
    """How the prefill dispatch reads ``w`` (a :class:`.prefill.PrefillWeights`) and the
    operand it passes (:func:`kernel_of`), or None: no kernel, or one that does not say its
    values."""
    from .registry import PREFILLS

    found = kernel_of(w)
    if found is None or found[0].layout_name not in PREFILLS:
        return None
    return PREFILLS[found[0].layout_name], found[1]


def prefill_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """``x @ w.T`` for a prompt's rows (``x`` ``[..., K]``, any number of rows, symbolic
    included) as one call of the prefill dispatch (:mod:`.prefill`: tiles of the weight
    converted to bfloat16 and reused by every row, ``vdpbf16ps``), or None where it does not
    apply: ``w`` neither quantized in a layout with such a dispatch nor plain float16
    (:func:`prefill_weights`), a shape :func:`.prefill.refusal` refuses, x not
    float32/bfloat16/float16, or a host CPU without AVX512-BF16 (:data:`BF16_DOT`). x is
    rounded to bfloat16 (the module's numerics note), the result returned in x's dtype."""
    from . import prefill
    from .custom_op import PREFILLS

    if x.dtype not in _PREFILL_X or isa.current().bf16_dot is None:
        return None
    found = prefill_weights(w)
    if found is None:
        return None
    weights, operand = found
    n, k = w.shape
    if prefill.refusal(weights, n, k) is not None:
        return None
    y = PREFILLS[weights.what](x.reshape(-1, k).to(torch.bfloat16), operand)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """Traced attention of one query per sequence (``q`` ``[B, H, 1, E]``) over a cache ``k``,
    ``v`` ``[B, KVH, T, E]`` (the cache ``[B, T, KVH, E]`` transposed, as
    ``layers.attention`` passes it) with a boolean ``mask`` broadcasting as ``[B, 1, 1, T]``
    (or None), as one dispatch (:mod:`.attention`): the kernel
    :func:`sharktank.ops.attention_kernels` takes. None where it does not apply: another
    query length or rank, symbolic sizes, a mask per head or not boolean, dtypes other than
    float32, bfloat16, float16, or T not a multiple of ``attention.CHUNK``."""
    from .attention import CHUNK
    from .custom_op import ELEMENT_TYPES, sharktank_decode_attention

    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or not all(isinstance(d, int) for d in (*q.shape, *k.shape)):
        return None
    (b, h, l, e), (kb, kvh, t, ke) = q.shape, k.shape
    if l != 1 or kb != b or ke != e or h % kvh or t % CHUNK or q.dtype not in ELEMENT_TYPES or k.dtype not in ELEMENT_TYPES or v.dtype != k.dtype:
        return None
    live = _live(mask, b, t)
    if live is None:
        return None
    out = sharktank_decode_attention(q.reshape(b, h, e), k.transpose(1, 2), v.transpose(1, 2), live, float(scale))
    return out.reshape(b, h, 1, e)


def _live(mask: torch.Tensor | None, b: int, t: int) -> torch.Tensor | None:
    """A boolean ``mask`` broadcasting as ``[B, 1, 1, T]`` (or None) as the kernels' int8
    ``[B, T]``; None for another mask (per head, additive)."""
    if mask is None:
        return torch.ones(b, t, dtype=torch.int8)
    if mask.dtype != torch.bool or mask.ndim != 4 or mask.shape[1:] != (1, 1, t) or mask.shape[0] not in (1, b):
        return None
    return mask.expand(b, 1, 1, t).reshape(b, t).to(torch.int8)


def _paged_shapes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor) -> tuple | None:
    """``(B, H, L, E, N, M)`` of paged attention's operands (``q`` ``[B, H, L, E]``, pools
    ``[P, N, KVH, E]``, an int64 table ``[B, M]``), or None where the dispatches do not take
    them: another rank, a B, H, E or pool dim (P aside) that is symbolic, H not a multiple of
    KVH, other dtypes than float32, bfloat16, float16. L, M and P may be symbolic."""
    from .custom_op import ELEMENT_TYPES

    if q.ndim != 4 or k_pool.ndim != 4 or v_pool.ndim != 4 or pages.ndim != 2 or pages.dtype != torch.int64:
        return None
    (b, h, l, e), (_, n, kvh, ke), (pb, m) = q.shape, k_pool.shape, pages.shape
    if not all(isinstance(d, int) for d in (b, h, e, *k_pool.shape[1:], *v_pool.shape[1:], pb)):
        return None
    if pb != b or ke != e or v_pool.shape[1:] != k_pool.shape[1:] or h % kvh:
        return None
    if q.dtype not in ELEMENT_TYPES or k_pool.dtype not in ELEMENT_TYPES or v_pool.dtype != k_pool.dtype:
        return None
    return b, h, l, e, n, m


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """Traced attention of one query per sequence (``q`` ``[B, H, 1, E]``) over each row's
    pages of the pools ``k_pool``, ``v_pool`` ``[P, N, KVH, E]`` (P may be symbolic) through
    the int64 page table ``pages`` ``[B, M]``, with a boolean ``mask`` broadcasting as ``[B,
    1, 1, M * N]`` (or None), as one dispatch reading the pool in place
    (:func:`.attention.paged_module_asm`): the paged kernel
    :func:`sharktank.ops.attention_kernels` takes. None where it does not apply: as
    :func:`decode_attention`, with ``M * N`` for T."""
    from .attention import CHUNK
    from .custom_op import sharktank_paged_decode_attention

    shapes = _paged_shapes(q, k_pool, v_pool, pages)
    if shapes is None:
        return None
    b, h, l, e, n, m = shapes
    if not (isinstance(l, int) and isinstance(m, int)) or l != 1 or m * n % CHUNK:
        return None
    live = _live(mask, b, m * n)
    if live is None:
        return None
    return sharktank_paged_decode_attention(q.reshape(b, h, e), k_pool, v_pool, pages, live, float(scale)).reshape(b, h, 1, e)


def paged_prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """Traced attention of a prompt chunk (``q`` ``[B, H, L, E]``, L symbolic or above 1) over
    each row's pages of the pools ``k_pool``, ``v_pool`` ``[P, N, KVH, E]`` through the int64
    page table ``pages`` ``[B, M]`` (M may be symbolic), with a boolean ``mask`` ``[B or 1, 1,
    L, M * N]`` (what each token attends: :func:`sharktank.layers.attention.causal_mask`) or
    None, as one dispatch reading the pool in place, each token's row of the mask walked as a
    decode step walks its own (:func:`.attention.paged_prefill_module_asm`). None where it
    does not apply: another rank, a static size that is symbolic, dtypes other than float32,
    bfloat16, float16, or a mask of another form (per head, additive)."""
    from .custom_op import sharktank_paged_prefill_attention

    shapes = _paged_shapes(q, k_pool, v_pool, pages)
    if shapes is None or (isinstance(shapes[2], int) and shapes[2] == 1):
        return None
    b, h, l, e, n, m = shapes
    if mask is None:
        live = torch.ones(b * l * m * n, dtype=torch.int8)
    elif mask.dtype == torch.bool and mask.ndim == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, b):
        live = mask[:, 0].expand(b, l, m * n).flatten().to(torch.int8)
    else:
        return None
    rows = q.transpose(1, 2).flatten(0, 1)  # [B * L, H, E]: sequence s's tokens are rows s * L ...
    out = sharktank_paged_prefill_attention(rows, k_pool, v_pool, pages.transpose(0, 1).contiguous(), live, float(scale))
    return out.unflatten(0, (b, l)).transpose(1, 2)


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """The paged kernel :func:`sharktank.ops.attention_kernels` takes for the CPU target:
    :func:`paged_decode_attention` for one query per sequence, :func:`paged_prefill_attention`
    for a prompt chunk."""
    if q.ndim == 4 and isinstance(q.shape[2], int) and q.shape[2] == 1:
        return paged_decode_attention(q, k_pool, v_pool, pages, mask, scale)
    return paged_prefill_attention(q, k_pool, v_pool, pages, mask, scale)


# Rows of x up to which a traced product takes the decode kernels (block_product): the
# exported decode batches. More rows, or a symbolic number (a prompt), take prefill_product.
DECODE_ROWS = 8


def _static_rows(x: torch.Tensor) -> int | None:
    rows = 1
    for d in x.shape[:-1]:
        if not isinstance(d, int):
            return None
        rows *= d
    return rows


class BlockProducts:
    """The kernel ``ops.block_kernels`` takes, for one traced program, for quantized and plain
    float16 weights: :func:`block_product` for a static number of rows up to
    :data:`DECODE_ROWS`, :func:`prefill_product` for more or a symbolic number. Where
    ``choice.exact_prompts``, a prompt's x other than bfloat16 keeps the dense product. The
    decode products of one x with weights of one int16-x layout (q, k; gate, up) share one
    rounding of x. One per trace: it holds each x it has rounded."""

    def __init__(self, choice: CpuKernels | None = None):
        self._rounded: dict = {}
        self._exact_prompts = choice is not None and choice.exact_prompts

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        rows = _static_rows(x)
        if rows is not None and rows <= DECODE_ROWS:
            return block_product(x, w, self._rounded)
        if self._exact_prompts and x.dtype != torch.bfloat16:
            return None
        return prefill_product(x, w)

    def expert(self, x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor | None:
        """Pair ``p``'s rows of ``x`` times ``w[expert[p]].T`` for stacked experts ``w`` ``[E,
        N, K]`` and int64 indexes ``[P]`` (in range), each expert's weight read in place:
        :func:`block_product` for a static number of rows per pair up to :data:`DECODE_ROWS`,
        else None."""
        rows = _static_rows(x)
        if rows is None or rows > DECODE_ROWS * expert.numel():
            return None
        return block_product(x, w, self._rounded, expert=expert)


def kernels_in(mlir: str) -> list[str]:
    """The hand-written dispatches an exported module calls (the manifest's ``cpu_kernels``):
    the registered layouts of its decode products (lower case, e.g. ``q8_0``), of its prompt
    products (``q8_0_prefill``; ``f16`` and ``f16_prefill`` for plain float16 weights),
    ``decode_attention``, ``paged_decode_attention`` and ``paged_prefill_attention``."""
    from . import prefill
    from .registry import PREFILLS

    found = [kernel.name for kernel in KERNELS.values() if f"@{kernel.function_prefix}" in mlir]
    found += [f"{weights.name}_prefill" for weights in PREFILLS.values() if f"@{prefill.function_prefix(weights)}" in mlir]
    return sorted(found + [name for name, prefix in _ATTENTION_PREFIXES.items() if prefix in mlir])
