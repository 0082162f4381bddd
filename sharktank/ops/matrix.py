"""Matrix ops: ``matmul`` and ``linear``.

Rule (plain tensors count as replicated; ``lhs`` is ``[..., m, k]``, ``rhs`` is
``[..., k, n]``):

======================  ======================  =========================================
lhs                     rhs                     result
======================  ======================  =========================================
replicated              replicated              replicated
split on m or a batch   replicated              split on that dim (column-local work)
replicated              split on n or a batch   split on that dim
split on k              split on k (same sizes) unreduced (partial sums)
split on k              replicated              unreduced (rhs cut locally along k)
replicated              split on k              unreduced (lhs cut locally along k)
unreduced               replicated              unreduced (linear in lhs)
replicated              unreduced               unreduced (linear in rhs)
======================  ======================  =========================================

Anything else (e.g. lhs split on m with rhs split on n) needs a collective first and is
refused with a :class:`ShardingError` that names both placements and shapes.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
import torch.nn.functional as F

from ..types import QuantizedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor
from ._build import ShardingError, cut_like_split, offsets, replicated_of, split_of, unreduced_of
from ._context import setting
from ._dispatch import sharded_op
from ._transfer import _tracing_tensor
from .elementwise import add

__all__ = ["matmul", "linear", "block_kernels"]

Operand = torch.Tensor | ShardedTensor


def _role(x, k_dim: int, free_dim: int) -> tuple[str, int | None]:
    if isinstance(x, UnreducedTensor):
        return "P", None
    if isinstance(x, SplitPrimitiveTensor):
        d = x.shard_dim
        return ("k" if d == k_dim else "free" if d == free_dim else "batch"), d
    return "R", None


def _describe(x) -> str:
    if isinstance(x, ShardedTensor):
        return f"{type(x).__name__} {x.placement} shape {list(x.shape)}"
    return f"torch.Tensor shape {list(x.shape)}"


# A plan says, for each operand, how to get its per-shard values: None (its own shards, or
# the plain tensor repeated), or (dim, batch): cut it along dim by the other operand's shard
# sizes; then the result kind ('R', 'P', 'S') and split dim. Plans depend only on types,
# ranks and split dims, so they are cached.
_PLANS: dict[tuple, tuple] = {}


def _plan(op: str, a, b, b_transposed: bool) -> tuple:
    ra, rb = a.ndim, b.ndim
    if ra < 2 or rb < 2:
        raise ShardingError(f"ops.{op} on sharded tensors needs rank >= 2 operands, found {_describe(a)} and {_describe(b)}")
    r = max(ra, rb)
    b_k, b_n = (rb - 1, rb - 2) if b_transposed else (rb - 2, rb - 1)
    (ka, da), (kb, db) = _role(a, ra - 1, ra - 2), _role(b, b_k, b_n)
    if ka in ("R", "P") and kb in ("R", "P") and not (ka == kb == "P"):
        return None, None, "P" if "P" in (ka, kb) else "R", None
    if ka == "k" and kb == "k":
        return None, None, "P", None
    if ka == "k" and kb == "R":
        return None, (b_k, False), "P", None
    if ka == "R" and kb == "k":
        return (ra - 1, False), None, "P", None
    if ka in ("free", "batch") and kb == "R":
        return None, ((da + rb - ra, True) if ka == "batch" else None), "S", da + r - ra
    if ka == "R" and kb in ("free", "batch"):
        return ((db + ra - rb, True) if kb == "batch" else None), None, "S", (r - 1 if kb == "free" else db + r - rb)
    if ka == "batch" and kb == "batch" and da + r - ra == db + r - rb:
        return None, None, "S", da + r - ra
    raise ShardingError(
        f"ops.{op}: no local computation for lhs {_describe(a)} with rhs {_describe(b)}"
        f"{' (transposed)' if b_transposed else ''}; reshard or all_gather one operand first"
    )


def _per_shard(x, cut, sizes, n: int, op: str = "matmul"):
    shards = x.shards if isinstance(x, ShardedTensor) else (x,) * n
    if cut is None:
        return shards
    dim, batch = cut
    if batch:
        return cut_like_split(shards, dim, sizes, op)  # batch dims broadcast
    return [s.narrow(dim, o, z) for s, o, z in zip(shards, offsets(sizes), sizes)]


def plan_matmul(op: str, a, b, b_transposed: bool):
    """Per-shard lhs and rhs values and the result's kind: ('R'|'P'|'S', result split dim)."""
    key = (type(a), type(b), getattr(a, "shard_dim", None), getattr(b, "shard_dim", None), a.ndim, b.ndim, b_transposed)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(op, a, b, b_transposed)
    cut_a, cut_b, kind, dim = plan
    sa, sb = isinstance(a, ShardedTensor), isinstance(b, ShardedTensor)
    if sa and sb and a.shard_count != b.shard_count:
        raise ShardingError(f"ops.{op}: operands have {a.shard_count} and {b.shard_count} shards")
    n = (a if sa else b).shard_count
    if cut_a is None and cut_b is None and isinstance(a, SplitPrimitiveTensor) and isinstance(b, SplitPrimitiveTensor):
        if a.shard_sizes != b.shard_sizes:
            raise ShardingError(f"ops.{op}: lhs is split into {a.shard_sizes} but rhs into {b.shard_sizes}")
    xs = _per_shard(a, cut_a, cut_a and b.shard_sizes, n)
    ws = _per_shard(b, cut_b, cut_b and a.shard_sizes, n)
    return xs, ws, (kind, dim)


def _build(kind, dim, out, devices):
    if kind == "S":
        return split_of(out, dim, devices)
    if kind == "P":
        return unreduced_of(out, devices)
    return replicated_of(out, devices)


def _devices(a, b):
    return (a if isinstance(a, ShardedTensor) else b).devices


@sharded_op(nargs=2)
def matmul(lhs: Operand, rhs: Operand, *, transpose_rhs: bool = False) -> Operand:
    """Matrix product ``lhs @ rhs`` (``lhs @ rhs.mT`` with ``transpose_rhs``), torch broadcasting.

    Sharded operands follow the table in :mod:`sharktank.ops.matrix`: replicated × split
    on the parallel dim gives split; split on the reduction dim gives unreduced (call
    :func:`all_reduce` to get the replicated sum).
    """


def _dense(w, like: torch.Tensor) -> torch.Tensor:
    """A quantized weight dequantized to ``like``'s dtype (inside the product, when traced);
    a plain float weight of another dtype converted to it (llama.cpp's files mix an F16
    output with quantized weights run in float32); a plain tensor of ``like``'s dtype as it is."""
    if isinstance(w, QuantizedTensor):
        return w.dequantize(like.dtype)
    return w.to(like.dtype) if w.dtype != like.dtype and w.is_floating_point() and like.is_floating_point() else w


# Traced products with a quantized weight and at most this many rows (a decode step of the
# exported batches) are written on the blocks (QuantizedTensor.product), which IREE fuses
# into one pass over them: an 8192x2048 Q8_0 matvec took 1.9-3.3 ms against 49 ms when the
# weight is dequantized first (then packed for the CPU's matmul kernels on every call). More
# rows (a prompt) amortise the dequantization over the rows and take the dense product,
# where no block kernel takes them.
_BLOCK_PRODUCT_ROWS = 8


def _few_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` has a static number of rows up to ``_BLOCK_PRODUCT_ROWS``."""
    rows = 1
    for d in x.shape[:-1]:
        if not isinstance(d, int):
            return False  # a symbolic length: a prompt
        rows *= d
    return rows <= _BLOCK_PRODUCT_ROWS


BlockKernel = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
_BLOCK_KERNEL: contextvars.ContextVar[BlockKernel | None] = contextvars.ContextVar("block_kernels", default=None)


def block_kernels(kernel: BlockKernel | None) -> contextlib.AbstractContextManager[None]:
    """While active, a traced product ``x @ w.T`` with a quantized or half 2-D ``w`` is
    ``kernel(x, w)`` (any number of rows, symbolic included: a decode step or a prompt); where
    it returns None, :meth:`QuantizedTensor.product` for a quantized ``w`` and a static number
    of rows up to ``_BLOCK_PRODUCT_ROWS``, else the dense product (of the dequantized weight).

    Export passes :class:`sharktank.export.kernels.BlockProducts` for the CPU target: its
    hand-written dispatches read the blocks at about the machine's read bandwidth in a decode
    step, where IREE's code for the torch form is compute-bound, and reuse each dequantized
    tile across a prompt's rows (a float16 weight's too: this CPU has no float16
    arithmetic; and a bfloat16 one's where it has no bfloat16 arithmetic). ``None`` turns
    kernels off (the kernel returns None for a weight it does not take)."""
    return setting(_BLOCK_KERNEL, kernel)


def _kernel_product(x: torch.Tensor, w) -> torch.Tensor | None:
    """``x @ w.T`` where it is traced, ``w`` 2-D and quantized or half: the active block
    kernel's, else (quantized) the torch form on the blocks for few rows; None: the dense
    product."""
    if w.ndim != 2 or not _tracing_tensor(x):
        return None
    quantized = isinstance(w, QuantizedTensor)
    if not quantized and w.dtype not in (torch.float16, torch.bfloat16):
        return None
    kernel = _BLOCK_KERNEL.get()
    y = kernel(x, w) if kernel is not None else None
    if y is None and quantized and _few_rows(x):
        y = w.product(x)
    return y


def expert_kernel_product(x: torch.Tensor, stacked, expert: torch.Tensor) -> torch.Tensor | None:
    """``x @ stacked[expert].T`` for a mixture of experts' stacked weights ``[E, N, K]`` and an
    int64 index of one (in range), where it is traced and the active block kernel has a form
    that reads that expert's weight in place (``kernel.expert``); None otherwise (the caller
    slices the expert's weight)."""
    form = getattr(_BLOCK_KERNEL.get(), "expert", None)
    if form is None or not _tracing_tensor(x):
        return None
    return form(x, stacked, expert)


@matmul.register(torch.Tensor, torch.Tensor)
def _matmul_torch(lhs, rhs, *, transpose_rhs=False):
    y = _kernel_product(lhs, rhs) if transpose_rhs else None
    if y is not None:
        return y
    rhs = _dense(rhs, lhs)
    # transpose(-2, -1), not .mT: torch-mlir has no lowering of aten.mT (a traced 3-D rhs kept it).
    return torch.matmul(lhs, rhs.transpose(-2, -1) if transpose_rhs else rhs)


def _matmul_sharded(lhs, rhs, *, transpose_rhs=False):
    xs, ws, (kind, dim) = plan_matmul("matmul", lhs, rhs, transpose_rhs)
    if transpose_rhs:
        out = [_matmul_torch(x, w, transpose_rhs=True) for x, w in zip(xs, ws)]
    else:
        out = [torch.matmul(x, _dense(w, x)) for x, w in zip(xs, ws)]
    return _build(kind, dim, out, _devices(lhs, rhs))


matmul.register(ShardedTensor, object)(_matmul_sharded)
matmul.register(object, ShardedTensor)(_matmul_sharded)


@sharded_op(nargs=2)
def linear(x: Operand, weight: Operand, bias: Operand | None = None) -> Operand:
    """``x @ weight.T + bias`` (``weight`` is ``[out, in]``, as ``torch.nn.functional.linear``).

    Tensor-parallel forms: column-parallel (``weight`` split on dim 0, ``bias`` split or
    replicated) gives a result split on its last dim; row-parallel (``x`` split on its last
    dim, ``weight`` split on dim 1) gives an unreduced result, and a replicated ``bias`` is
    added to one shard only so that ``all_reduce`` counts it once.
    """


_HALF = (torch.float16, torch.bfloat16)


def _f_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``. Traced in half precision, the product is written as one 2-D product
    (rows of ``x`` flattened): torch-mlir gives a 2-D product of half operands a float32
    accumulator, as torch's CPU kernels compute it eagerly, while a batched product would
    accumulate in the half type. The weight stays in its dtype (no float32 copy of it); a
    quantized weight is dequantized to ``x``'s dtype right before the product."""
    y = _kernel_product(x, w)
    if y is not None:
        return y if b is None else y + b
    w = _dense(w, x)
    if x.dtype in _HALF and x.ndim != 2 and _tracing_tensor(x):
        y = F.linear(x.reshape(-1, x.shape[-1]), w, b)
        return y.reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, b)


@linear.register(torch.Tensor, torch.Tensor)
def _linear_torch(x, weight, bias=None):
    if isinstance(bias, ShardedTensor):
        return add(_f_linear(x, weight), bias)
    return _f_linear(x, weight, bias)


def _linear_sharded(x, weight, bias=None):
    if weight.ndim != 2:
        raise ShardingError(f"ops.linear expects a 2-D weight, found {_describe(weight)}")
    xs, ws, (kind, dim) = plan_matmul("linear", x, weight, True)
    devices = _devices(x, weight)
    if bias is None:
        return _build(kind, dim, [_f_linear(a, w) for a, w in zip(xs, ws)], devices)
    if isinstance(bias, UnreducedTensor):
        raise ShardingError("ops.linear: an unreduced bias is not supported; all_reduce it first")
    n = len(xs)
    if kind == "P":
        if isinstance(bias, SplitPrimitiveTensor):
            raise ShardingError(f"ops.linear: the result is unreduced but the bias is split ({_describe(bias)})")
        bs = _per_shard(bias, None, None, n)
        out = [_f_linear(xs[0], ws[0], bs[0])] + [_f_linear(a, w) for a, w in zip(xs[1:], ws[1:])]
        return unreduced_of(out, devices)
    if kind == "S" and dim == max(x.ndim, 2) - 1:
        sizes = [w.shape[0] for w in ws]
        if isinstance(bias, SplitPrimitiveTensor):
            if bias.shard_sizes != sizes:
                raise ShardingError(f"ops.linear: bias split {bias.shard_sizes} does not match the output split {sizes}")
            bs = bias.shards
        else:
            bs = _per_shard(bias, (0, False), sizes, n)
    elif isinstance(bias, SplitPrimitiveTensor):
        raise ShardingError(f"ops.linear: bias {_describe(bias)} is split but the output is not split on its last dim")
    else:
        bs = _per_shard(bias, None, None, n)
    return _build(kind, dim, [_f_linear(a, w, b) for a, w, b in zip(xs, ws, bs)], devices)


linear.register(ShardedTensor, object)(_linear_sharded)
linear.register(object, ShardedTensor)(_linear_sharded)
