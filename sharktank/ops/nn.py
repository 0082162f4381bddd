"""Neural-network ops: softmax, norms, attention, embedding lookup.

Rule: each op normalizes or gathers along some dims; a split on any other dim stays
split and the op runs shard by shard (replicated and plain operands are cut locally to
match). A split on a dim the op works along is refused, naming the dim, except the
vocabulary-parallel embedding lookup, which gives an unreduced result.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
import torch.nn.functional as F

from ..types import QuantizedTensor, ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor
from ._build import ShardingError, like, norm_dim, offsets, unreduced_of
from ._context import setting
from ._dispatch import sharded_op
from ._transfer import _tracing_tensor
from .elementwise import shardwise

__all__ = ["softmax", "rms_norm", "layer_norm", "scaled_dot_product_attention", "paged_attention", "attention_as_matmuls", "attention_kernels", "embedding_lookup"]

AnyTensor = torch.Tensor | ShardedTensor


def _refuse_dims(op: str, t, dims) -> None:
    if isinstance(t, UnreducedTensor):
        raise ShardingError(f"ops.{op} is not linear and got an UnreducedTensor; call ops.all_reduce first")
    if isinstance(t, SplitPrimitiveTensor) and t.shard_dim in dims:
        raise ShardingError(
            f"ops.{op} works along dim {t.shard_dim} of {list(t.shape)}, which is split "
            f"{t.shard_sizes}; all_gather or reshard first"
        )


@sharded_op()
def softmax(t: AnyTensor, dim: int, dtype: torch.dtype | None = None) -> AnyTensor:
    """Softmax along ``dim`` (optionally computed in ``dtype``); ``dim`` must not be split."""


softmax.register(torch.Tensor)(lambda t, dim, dtype=None: torch.softmax(t, dim, dtype=dtype))


@softmax.register(ShardedTensor)
def _softmax(t, dim, dtype=None):
    d = norm_dim(dim, t.ndim)
    _refuse_dims("softmax", t, [d])
    return like(t, [torch.softmax(s, d, dtype=dtype) for s in t.shards])


def _rms(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    # Normalize in float32 and scale in x's dtype, as the Hugging Face reference does. The
    # mean square comes from a float32 norm of x itself (not of a float32 copy of x): the
    # copy, read by both the reduction and the scaling, would be its own kernel in IREE.
    norm = torch.linalg.vector_norm(x, 2, -1, keepdim=True, dtype=torch.float32)
    y = (x.float() * torch.rsqrt(norm * norm / x.shape[-1] + epsilon)).to(x.dtype)
    return (weight if weight.dtype == x.dtype else weight.to(x.dtype)) * y


@sharded_op(nargs=2)
def rms_norm(x: AnyTensor, weight: AnyTensor, *, epsilon: float) -> AnyTensor:
    """RMS normalization over the last dim, scaled by ``weight`` (float32 accumulation).
    The last dim must not be split."""


rms_norm.register(torch.Tensor, torch.Tensor)(_rms)


@rms_norm.register(object, object)
def _rms_sharded(x, weight, *, epsilon):
    _refuse_dims("rms_norm", x, [x.ndim - 1])
    _refuse_dims("rms_norm", weight, [weight.ndim - 1])
    return shardwise("rms_norm", lambda a, w: _rms(a, w, epsilon), (x, weight))


@sharded_op(nargs=3)
def layer_norm(x: AnyTensor, weight: AnyTensor | None, bias: AnyTensor | None, *, eps: float = 1e-5) -> AnyTensor:
    """Layer normalization over the trailing ``weight.ndim`` dims (the last dim when
    ``weight`` is None). Those dims must not be split."""


@layer_norm.register(torch.Tensor, object, object)
def _layer_norm_torch(x, weight, bias, *, eps=1e-5):
    if isinstance(weight, ShardedTensor) or isinstance(bias, ShardedTensor):
        return _layer_norm_sharded(x, weight, bias, eps=eps)
    k = 1 if weight is None else weight.ndim
    return F.layer_norm(x, x.shape[-k:], weight, bias, eps)


@layer_norm.register(ShardedTensor, object, object)
def _layer_norm_sharded(x, weight, bias, *, eps=1e-5):
    k = 1 if weight is None else weight.ndim
    _refuse_dims("layer_norm", x, range(x.ndim - k, x.ndim))
    for p in (weight, bias):
        if p is not None:
            _refuse_dims("layer_norm", p, range(p.ndim))
    shape = list(x.shape[-k:])
    operands = [o for o in (x, weight, bias) if o is not None]

    def fn(a, *wb):
        w = wb[0] if weight is not None else None
        b = wb[-1] if bias is not None else None
        return F.layer_norm(a, shape, w, b, eps)

    return shardwise("layer_norm", fn, tuple(operands))


@sharded_op(nargs=3)
def scaled_dot_product_attention(
    q: AnyTensor,
    k: AnyTensor,
    v: AnyTensor,
    a: AnyTensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> AnyTensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on ``[..., L, E]`` operands with an
    optional additive or boolean mask ``a``. ``enable_gqa``: k and v may have fewer heads
    (dim -3) than q, each serving a group of consecutive q heads. Sharded: q, k and v split on
    the same head or batch dim (not the last two; with GQA, heads split into the same number
    of groups per shard), or replicated; the mask is cut to match. k and v are computed in
    q's dtype (a half-precision cache attends in float32 when q is float32). See
    :func:`attention_as_matmuls` for the unfused form export uses."""


@scaled_dot_product_attention.register(torch.Tensor, torch.Tensor, torch.Tensor)
def _sdpa_torch(q, k, v, a=None, *, is_causal=False, scale=None, enable_gqa=False):
    if isinstance(a, ShardedTensor):
        return _sdpa_sharded(q, k, v, a, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _sdpa(q, k, v, a, is_causal, scale, enable_gqa)


_AS_MATMULS = contextvars.ContextVar("attention_as_matmuls", default=False)


def attention_as_matmuls(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """While active, :func:`scaled_dot_product_attention` is computed unfused, as scores, a
    softmax and a product with the values (eagerly and when traced), instead of one fused
    attention op.

    Export enables it for every target: IREE 3.10's fused attention kernel on CPU took ~80 %
    of toy-llama-3l's prefill (2.2 ms; 1.1 ms as products), and it does not compile for
    CUDA (sm_80) or HIP (gfx942) on the toy models. With a static query length (decode) a
    grouped KV head is not repeated: the query heads it serves are stacked into one operand,
    and the score product is a multiply-and-sum (one reduction kernel in IREE, reading the
    cache as stored); with a dynamic one (prefill) K and V are repeated per query head."""
    return setting(_AS_MATMULS, enabled)


AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], "torch.Tensor | None"]
PagedAttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], "torch.Tensor | None"]
_ATTENTION_KERNEL: contextvars.ContextVar[AttentionKernel | None] = contextvars.ContextVar("attention_kernels", default=None)
_PAGED_KERNEL: contextvars.ContextVar[PagedAttentionKernel | None] = contextvars.ContextVar("paged_attention_kernels", default=None)


@contextlib.contextmanager
def _kernels(kernel: AttentionKernel | None, paged: PagedAttentionKernel | None):
    with setting(_ATTENTION_KERNEL, kernel), setting(_PAGED_KERNEL, paged):
        yield


def attention_kernels(kernel: AttentionKernel | None, paged: PagedAttentionKernel | None = None) -> contextlib.AbstractContextManager[None]:
    """While active, a traced :func:`scaled_dot_product_attention` (not ``is_causal``; per
    shard) is first offered to ``kernel(q, k, v, mask, scale)``, with the operands as the op
    takes them (k and v in their own dtype) and ``scale`` resolved; where it returns None
    (a shape or mask it has no dispatch for) the op is computed as without it. Likewise a
    traced :func:`paged_attention` (per shard) is first offered to ``paged(q, k_pool, v_pool,
    pages, mask, scale)``; without ``paged`` it is computed as its torch form, whose
    attention over the gathered pages is then offered to ``kernel``.

    Export passes :func:`sharktank.export.kernels.decode_attention` and
    :func:`~sharktank.export.kernels.paged_attention` for the CPU target: one dispatch
    for a decode step's attention over the cache (or through the page table into the pool),
    and one for a prompt chunk's through the page table, reading only the entries the mask
    keeps. ``None`` turns them off."""
    return _kernels(kernel, paged)


def _masked(s, a):
    return s if a is None else s.masked_fill(~a, float("-inf")) if a.dtype == torch.bool else s + a


def _sdpa_matmuls(q, k, v, a, scale):
    # q [..., H, L, E] with H = kvH * g; k and v [..., kvH, T, E]; mask [..., 1 or H, L, T].
    *lead, h, l, e = q.shape
    kvh = k.shape[-3]
    g = h // kvh
    scale = e ** -0.5 if scale is None else scale
    if not isinstance(l, int) or g == 1:
        # A dynamic query length (prefill): K and V repeated per query head, 4-D products.
        # (A reshape with a dynamic L makes torch.export guard on strides it cannot prove,
        # and IREE 3.10 mistypes broadcasting 5-D products when a dim is 1.)
        if g > 1:
            k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
        p = torch.softmax(_masked(torch.matmul(q, k.transpose(-2, -1)) * scale, a), -1)
        return torch.matmul(p, v)
    # A static query length (decode): each KV head's g query heads are stacked into one
    # [g*L, E] operand, so K and V are read once, not repeated. The score product is written
    # as multiply-and-sum, which IREE compiles to one reduction kernel reading the K cache in
    # its own dtype (as a product, data tiling first writes a packed float32 copy of the
    # cache). The value product stays a product: as a sum over T, IREE 3.10 does not fuse
    # the multiply into the reduction and writes a [kvH, g*L, T, E] float32 tensor.
    s = (q.reshape(*lead, kvh, g * l, 1, e) * k.unsqueeze(-3)).sum(-1) * scale
    s = s.reshape(*lead, kvh, g, l, -1)
    if a is not None and a.ndim >= 3:  # [..., 1 or H, L, T] -> [..., 1 or kvH, 1 or g, L, T]
        a = a.unflatten(-3, (kvh, g)) if a.shape[-3] != 1 else a.unsqueeze(-3)
    p = torch.softmax(_masked(s, a), -1)
    return torch.matmul(p.reshape(*lead, kvh, g * l, -1), v).reshape(*lead, h, l, e)


def _sdpa(q, k, v, a, is_causal, scale, gqa):
    kernel = _ATTENTION_KERNEL.get()
    if kernel is not None and not is_causal and _tracing_tensor(q) and q.ndim >= 3 and (q.shape[-3] == k.shape[-3] or gqa):
        y = kernel(q, k, v, a, q.shape[-1] ** -0.5 if scale is None else scale)
        if y is not None:
            return y
    k, v = k.to(q.dtype), v.to(q.dtype)
    if _AS_MATMULS.get() and not is_causal and q.ndim >= 3 and (q.shape[-3] == k.shape[-3] or gqa):
        return _sdpa_matmuls(q, k, v, a, scale)
    if gqa and q.shape[-3] != k.shape[-3]:
        # Repeat KV heads here rather than passing enable_gqa: IREE 3.10's lowering of
        # enable_gqa with a mask fails to compile ("mask sequence length ... mismatch").
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=a, is_causal=is_causal, scale=scale)


@scaled_dot_product_attention.register(object, object, object)
def _sdpa_sharded(q, k, v, a=None, *, is_causal=False, scale=None, enable_gqa=False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _refuse_dims("scaled_dot_product_attention", t, [t.ndim - 2, t.ndim - 1])
    if enable_gqa and q.shape[-3] != k.shape[-3] and any(isinstance(t, SplitPrimitiveTensor) for t in (q, k, v)):
        return _sdpa_gqa(q, k, v, a, is_causal=is_causal, scale=scale)
    if a is not None:
        _refuse_dims("scaled_dot_product_attention", a, [a.ndim - 2, a.ndim - 1])
    operands = (q, k, v) if a is None else (q, k, v, a)

    def fn(q_, k_, v_, a_=None):
        return _sdpa(q_, k_, v_, a_, is_causal, scale, enable_gqa)

    return shardwise("scaled_dot_product_attention", fn, operands)


def _mask_shards(a, q, head_dim: int, n: int) -> list:
    """Each of ``n`` shards' mask: ``a`` replicated or plain (or None); a mask per query head
    (dim -3 as long as q's heads, dim ``head_dim`` of the split ``q``) cut as q's heads are."""
    masks = list(a.shards) if isinstance(a, ReplicatedTensor) else [a] * n
    if a is not None and a.ndim >= 3 and a.shape[-3] == q.shape[head_dim] != 1:  # a mask per q head
        masks = [m.narrow(-3, o, size) for m, o, size in zip(masks, offsets(q.shard_sizes), q.shard_sizes)]
    return masks


def _sdpa_gqa(q, k, v, a, *, is_causal, scale):
    # Heads differ between q and k/v, so the elementwise alignment does not apply: every
    # sharded operand must be split on the head dim (-3) into the same number of groups.
    op = "scaled_dot_product_attention"
    ts = [t for t in (q, k, v, a) if isinstance(t, ShardedTensor)]
    n = ts[0].shard_count
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not (isinstance(t, SplitPrimitiveTensor) and t.shard_dim == t.ndim - 3):
            raise ShardingError(f"ops.{op} with GQA needs q, k and v split on the head dim (-3); {name} is {t!r}")
    groups = q.shape[-3] // k.shape[-3]
    if [s * groups for s in k.shard_sizes] != q.shard_sizes or k.shard_sizes != v.shard_sizes:
        raise ShardingError(
            f"ops.{op}: q heads split {q.shard_sizes} do not line up with kv heads split {k.shard_sizes} "
            f"(groups of {groups}); split kv heads evenly across shards"
        )
    if isinstance(a, SplitPrimitiveTensor) or isinstance(a, UnreducedTensor):
        raise ShardingError(f"ops.{op} with GQA takes a replicated or plain mask")
    masks = _mask_shards(a, q, q.ndim - 3, n)
    out = [_sdpa(q_, k_, v_, m, is_causal, scale, True) for q_, k_, v_, m in zip(q.shards, k.shards, v.shards, masks)]
    return like(q, out)


@sharded_op(nargs=5)
def paged_attention(
    q: AnyTensor,
    k_pool: AnyTensor,
    v_pool: AnyTensor,
    pages: AnyTensor,
    mask: AnyTensor | None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> AnyTensor:
    """Attention of ``q`` ``[B, H, L, E]`` over each row's pages of a pool: ``k_pool``,
    ``v_pool`` ``[P, N, KVH, E]`` (P pages of N entries, as stored), ``pages`` ``[B, M]``
    int64 (row b's entry t is slot t % N of page ``pages[b, t // N]``), ``mask`` as
    :func:`scaled_dot_product_attention` takes it over the ``M * N`` entries (or None). It is
    that op over the pages gathered (k, v ``[B, KVH, M * N, E]``). Traced with a paged kernel
    active (:func:`attention_kernels`), it is first offered to it, which reads the pool
    through the table instead. Sharded: q split on its heads (dim 1) and both pools on their
    KV heads (dim 2) in the same groups, or none of them split; pages and mask replicated or
    plain."""


def _gathered(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Each row's pages of ``pool`` in order, as ``[B, KVH, M * N, E]``: one index_select
    of the flattened pool (IREE 3.10 does not lower indexing by two tensors)."""
    b, m = pages.shape
    n = pool.shape[1]
    flat = (pages[:, :, None] * n + torch.arange(n)[None, None, :]).reshape(-1)
    return pool.flatten(0, 1).index_select(0, flat).unflatten(0, [b, m * n]).transpose(1, 2)


def _paged(q, k_pool, v_pool, pages, a, scale, gqa):
    kernel = _PAGED_KERNEL.get()
    if kernel is not None and _tracing_tensor(q) and q.ndim == 4 and (q.shape[1] == k_pool.shape[2] or gqa):
        y = kernel(q, k_pool, v_pool, pages, a, q.shape[-1] ** -0.5 if scale is None else scale)
        if y is not None:
            return y
    return _sdpa(q, _gathered(k_pool, pages), _gathered(v_pool, pages), a, False, scale, gqa)


@paged_attention.register(torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, object)
def _paged_torch(q, k_pool, v_pool, pages, mask, *, scale=None, enable_gqa=False):
    if isinstance(mask, ShardedTensor):
        return _paged_sharded(q, k_pool, v_pool, pages, mask, scale=scale, enable_gqa=enable_gqa)
    return _paged(q, k_pool, v_pool, pages, mask, scale, enable_gqa)


def _placed(t) -> str:
    return f"{list(t.shape)} {t.placement}" if isinstance(t, ShardedTensor) else f"{list(t.shape)} plain"


@paged_attention.register(object, object, object, object, object)
def _paged_sharded(q, k_pool, v_pool, pages, mask, *, scale=None, enable_gqa=False):
    op = "paged_attention"
    named = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "pages": pages, "mask": mask}
    for name, t in named.items():
        if isinstance(t, UnreducedTensor):
            raise ShardingError(f"ops.{op} is not linear and got an UnreducedTensor ({name}); call ops.all_reduce first")
    for name in ("pages", "mask"):
        if isinstance(named[name], SplitPrimitiveTensor):
            raise ShardingError(f"ops.{op} takes a replicated or plain {name}, found {_placed(named[name])}")
    split = [isinstance(t, SplitPrimitiveTensor) for t in (q, k_pool, v_pool)]
    if any(split):
        if not all(split) or (q.shard_dim, k_pool.shard_dim, v_pool.shard_dim) != (1, 2, 2):
            raise ShardingError(
                f"ops.{op} takes q split on its heads (dim 1) and both pools on their KV heads (dim 2), or none of them split; "
                f"found q {_placed(q)}, k_pool {_placed(k_pool)}, v_pool {_placed(v_pool)}"
            )
        groups = q.shape[1] // k_pool.shape[2]
        if [s * groups for s in k_pool.shard_sizes] != q.shard_sizes or k_pool.shard_sizes != v_pool.shard_sizes:
            raise ShardingError(
                f"ops.{op}: q heads of {list(q.shape)} split {q.shard_sizes} do not line up with the pools' KV heads of "
                f"{list(k_pool.shape)} split {k_pool.shard_sizes} (groups of {groups}); split KV heads evenly across shards"
            )
    ref = next(t for t in named.values() if isinstance(t, ShardedTensor))
    n = ref.shard_count
    for name, t in named.items():
        if isinstance(t, ShardedTensor) and t.shard_count != n:
            raise ShardingError(f"ops.{op}: operands have {n} and {t.shard_count} shards ({name})")

    def shards(t):
        return t.shards if isinstance(t, ShardedTensor) else (t,) * n

    masks = _mask_shards(mask, q, 1, n) if split[0] else shards(mask)
    out = [_paged(*row, scale, enable_gqa) for row in zip(shards(q), shards(k_pool), shards(v_pool), shards(pages), masks)]
    return like(q if isinstance(q, ShardedTensor) else ref, out)


@sharded_op(nargs=2)
def embedding_lookup(input: AnyTensor, embedding_matrix: AnyTensor, dtype: torch.dtype | None = None) -> AnyTensor:
    """Rows of ``embedding_matrix`` (``[vocab, dim]``) for the token ids in ``input``, in ``dtype``.

    Sharded: a replicated matrix keeps the ids' placement; a matrix split on dim 1 gives a
    result split on its last dim; a matrix split on dim 0 (vocabulary-parallel) gives an
    unreduced result: each shard looks up the ids in its own rows and zeroes the others.
    """


def _lookup(ids: torch.Tensor, table) -> torch.Tensor:
    """Rows of a plain table, or of a quantized one (only the looked-up rows' blocks are
    expanded, in the table's dtype)."""
    if isinstance(table, QuantizedTensor):
        if table.ndim != 2:
            raise ValueError(f"ops.embedding_lookup expects a [vocab, dim] table, found {table!r}")
        return table.with_blocks(table.blocks[ids], (*ids.shape, table.shape[1])).dequantize()
    return F.embedding(ids, table)


@embedding_lookup.register(torch.Tensor, torch.Tensor)
def _embedding_torch(input, embedding_matrix, dtype=None):
    out = _lookup(input, embedding_matrix)
    return out if dtype is None else out.to(dtype)


@embedding_lookup.register(object, object)
def _embedding_sharded(input, embedding_matrix, dtype=None):
    w = embedding_matrix
    if isinstance(input, (SplitPrimitiveTensor, UnreducedTensor)) and isinstance(w, SplitPrimitiveTensor):
        raise ShardingError("ops.embedding_lookup: split ids with a split embedding matrix; replicate one of them first")
    if isinstance(w, UnreducedTensor) or isinstance(input, UnreducedTensor):
        raise ShardingError("ops.embedding_lookup: unreduced operands are not supported")

    def lookup(ids, rows):
        out = _lookup(ids, rows)
        return out if dtype is None else out.to(dtype)

    ref = w if isinstance(w, ShardedTensor) else input
    ids = input.shards if isinstance(input, ShardedTensor) else (input,) * ref.shard_count
    rows = w.shards if isinstance(w, ShardedTensor) else (w,) * ref.shard_count
    if isinstance(w, SplitPrimitiveTensor) and w.shard_dim == 0:
        out = []
        for i_, r, start in zip(ids, rows, offsets(w.shard_sizes)):
            if r.shape[0] == 0:  # an empty vocabulary shard contributes zeros
                out.append(torch.zeros((*i_.shape, r.shape[1]), dtype=dtype or r.dtype))
                continue
            local = i_ - start
            mine = (local >= 0) & (local < r.shape[0])
            e = lookup(torch.where(mine, local, torch.zeros_like(local)), r)
            out.append(e * mine.unsqueeze(-1).to(e.dtype))
        return unreduced_of(out, w.devices)
    out = [lookup(i_, r) for i_, r in zip(ids, rows)]
    if isinstance(w, SplitPrimitiveTensor):
        return like(w, out, input.ndim)
    return like(input, out) if isinstance(input, ShardedTensor) else like(w, out)
