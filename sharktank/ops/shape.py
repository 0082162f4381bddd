"""View and shape ops: transpose, permute, reshape, view, flatten, unflatten, expand, narrow, cat.

Rule: replicated and unreduced tensors reshape shard by shard (a view is linear). A split
tensor keeps its split: permutations carry the split dim along; a reshape may merge the
split dim with the dims after it, or split it into dims whose outer one carries the
split, as long as every shard stays one contiguous block of the result. A reshape that
would move elements between shards is refused with both shapes in the message. flatten and
unflatten say which dims they merge or divide, so they never guess among size-1 dims (a
one-head shard ``[N, 1 * hd]`` unflattened to ``[N, 1, hd]`` stays split on its heads):
prefer them to reshape where a dim may be 1.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..types import ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor
from ._build import ShardingError, like, norm_dim, offsets, split_of
from ._dispatch import sharded_op

__all__ = ["transpose", "permute", "reshape", "view", "flatten", "unflatten", "expand", "narrow", "cat"]

AnyTensor = torch.Tensor | ShardedTensor


@sharded_op()
def transpose(t: AnyTensor, dim0: int, dim1: int) -> AnyTensor:
    """Swap two dims (a split dim moves with them)."""


transpose.register(torch.Tensor)(torch.transpose)


@transpose.register(ShardedTensor)
def _transpose(t, dim0, dim1):
    a, b = norm_dim(dim0, t.ndim), norm_dim(dim1, t.ndim)
    dim = None
    if isinstance(t, SplitPrimitiveTensor):
        dim = {a: b, b: a}.get(t.shard_dim, t.shard_dim)
    return like(t, [s.transpose(a, b) for s in t.shards], dim)


@sharded_op()
def permute(t: AnyTensor, dims: Sequence[int]) -> AnyTensor:
    """Reorder dims (``torch.permute``); a split dim moves with its data."""


permute.register(torch.Tensor)(lambda t, dims: t.permute(*dims))


@permute.register(ShardedTensor)
def _permute(t, dims):
    dims = [norm_dim(d, t.ndim) for d in dims]
    dim = dims.index(t.shard_dim) if isinstance(t, SplitPrimitiveTensor) else None
    return like(t, [s.permute(*dims) for s in t.shards], dim)


def _resolve_shape(shape: Sequence[int], numel: int, src) -> list[int]:
    # No int(): sizes may be symbolic while tracing, and int() would specialize them.
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ValueError(f"only one -1 allowed in shape {shape}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or numel % known:
            raise ValueError(f"cannot reshape {list(src)} to {shape}")
        shape[shape.index(-1)] = numel // known
    if math.prod(shape) != numel:
        raise ValueError(f"cannot reshape {list(src)} ({numel} elements) to {shape}")
    return shape


def _split_reshape(t: SplitPrimitiveTensor, shape: list[int], op: str):
    """New split dim and per-shard shapes for reshaping split ``t`` to ``shape``."""
    src = list(t.shape)
    d = t.shard_dim
    inner = math.prod(src[d + 1 :])  # elements after the split dim, per index of it
    outer = math.prod(src[:d])
    # Find the output dim k where the split dim's block starts: prod(shape[:k]) == outer.
    acc, k = 1, 0
    while k < len(shape) and acc < outer:
        acc *= shape[k]
        k += 1
    while k < len(shape) - 1 and shape[k] == 1 and acc == outer and math.prod(shape[k + 1 :]) == src[d] * inner:
        k += 1  # skip leading size-1 dims that are not the split
    if acc != outer or k >= len(shape):
        raise ShardingError(f"ops.{op}: reshape {src} -> {shape} (split dim {d}) moves items between shards")
    new_inner = math.prod(shape[k + 1 :])
    shapes = []
    for size in t.shard_sizes:
        block = size * inner  # elements of this shard per outer index
        if block % new_inner:
            raise ShardingError(
                f"ops.{op}: reshape {src} -> {shape} (split dim {d} in sizes {t.shard_sizes}) moves items between shards"
            )
        local = list(shape)
        local[k] = block // new_inner
        shapes.append(local)
    # Shards must tile dim k in consecutive blocks: true when each block is whole rows of dim k.
    return k, shapes


def _reshape_impl(op: str, method: str):
    def impl(t, shape):
        shape = _resolve_shape(shape, math.prod(t.shape), t.shape)
        if isinstance(t, SplitPrimitiveTensor):
            k, shapes = _split_reshape(t, shape, op)
            return split_of([getattr(s, method)(sh) for s, sh in zip(t.shards, shapes)], k, t.devices)
        return like(t, [getattr(s, method)(shape) for s in t.shards])

    return impl


@sharded_op()
def reshape(t: AnyTensor, shape: Sequence[int]) -> AnyTensor:
    """``torch.reshape``; a split tensor keeps each shard a contiguous block (see module rule)."""


@sharded_op()
def view(t: AnyTensor, shape: Sequence[int]) -> AnyTensor:
    """``Tensor.view``; same rule as :func:`reshape`."""


reshape.register(torch.Tensor)(lambda t, shape: t.reshape(list(shape)))
reshape.register(ShardedTensor)(_reshape_impl("reshape", "reshape"))
view.register(torch.Tensor)(lambda t, shape: t.view(list(shape)))
view.register(ShardedTensor)(_reshape_impl("view", "view"))


@sharded_op()
def flatten(t: AnyTensor, start_dim: int = 0, end_dim: int = -1) -> AnyTensor:
    """Merge dims ``start_dim..end_dim`` (a reshape)."""


@flatten.register(object)
def _flatten(t, start_dim=0, end_dim=-1):
    if t.ndim == 0:
        return reshape(t, [1])
    a, b = norm_dim(start_dim, t.ndim), norm_dim(end_dim, t.ndim)
    shape = list(t.shape)
    if isinstance(t, SplitPrimitiveTensor) and not a <= t.shard_dim <= b:
        # The split dim is outside the merged dims: it only shifts (no size-1 dims to misread).
        d = t.shard_dim if t.shard_dim < a else t.shard_dim - (b - a)
        return split_of([sh.flatten(a, b) for sh in t.shards], d, t.devices)
    return reshape(t, shape[:a] + [math.prod(shape[a : b + 1])] + shape[b + 1 :])


@sharded_op()
def unflatten(t: AnyTensor, dim: int, sizes: Sequence[int]) -> AnyTensor:
    """Split dim ``dim`` into ``sizes`` (a reshape)."""


@unflatten.register(object)
def _unflatten(t, dim, sizes):
    d = norm_dim(dim, t.ndim)
    shape = list(t.shape)
    sizes = _resolve_shape(sizes, shape[d], [shape[d]])
    if isinstance(t, SplitPrimitiveTensor):
        if d != t.shard_dim:  # the split dim only shifts
            k = t.shard_dim + (len(sizes) - 1 if t.shard_dim > d else 0)
            return split_of([sh.unflatten(d, sizes) for sh in t.shards], k, t.devices)
        # The split dim itself: the split goes to the outermost new dim every shard tiles in
        # whole rows ([kv*hd] -> [kv, hd] splits the heads, or hd when a shard holds part of
        # a head), with only size-1 dims before it. Unlike reshape, sizes of 1 are not
        # guessed at: the caller said which dim is divided.
        for j in range(len(sizes)):
            if math.prod(sizes[:j]) != 1:
                break
            rows = math.prod(sizes[j + 1 :])
            if all(size % rows == 0 for size in t.shard_sizes):
                local = [[*sizes[:j], size // rows, *sizes[j + 1 :]] for size in t.shard_sizes]
                return split_of([sh.unflatten(d, sz) for sh, sz in zip(t.shards, local)], d + j, t.devices)
        raise ShardingError(
            f"ops.unflatten: dim {d} of {list(t.shape)} split in sizes {t.shard_sizes} cannot become {sizes} "
            "without moving items between shards"
        )
    return reshape(t, shape[:d] + sizes + shape[d + 1 :])


@sharded_op()
def expand(t: AnyTensor, shape: Sequence[int]) -> AnyTensor:
    """``Tensor.expand``; a split dim cannot be expanded (its size stays)."""


expand.register(torch.Tensor)(lambda t, shape: t.expand(*shape))


@expand.register(ShardedTensor)
def _expand(t, shape):
    shape = list(shape)
    if not isinstance(t, SplitPrimitiveTensor):
        return like(t, [s.expand(*shape) for s in t.shards])
    d = t.shard_dim + len(shape) - t.ndim
    if shape[d] not in (-1, t.shape[t.shard_dim]):
        raise ShardingError(f"ops.expand: cannot expand split dim {t.shard_dim} of {list(t.shape)} to {shape}")
    out = []
    for s in t.shards:
        local = list(shape)
        local[d] = -1
        out.append(s.expand(*local))
    return split_of(out, d, t.devices)


@sharded_op()
def narrow(t: AnyTensor, dim: int, start: int, length: int) -> AnyTensor:
    """``torch.narrow``: ``length`` entries of ``dim`` from ``start`` (a view; ``length`` may
    be a symbolic size while tracing). Sharded: each shard narrows alike; a split tensor
    cannot be narrowed on its split dim (that would leave shards of different sizes)."""


narrow.register(torch.Tensor)(torch.narrow)


@narrow.register(ShardedTensor)
def _narrow(t, dim, start, length):
    d = norm_dim(dim, t.ndim)
    split = t.shard_dim if isinstance(t, SplitPrimitiveTensor) else None
    if split == d:
        raise ShardingError(f"ops.narrow: cannot narrow the split dim {d} of {list(t.shape)}; all_gather or reshard first")
    return like(t, [s.narrow(d, start, length) for s in t.shards], split)


def _cat_key(tensors, dim=0):
    return tensors


@sharded_op(key=_cat_key)
def cat(tensors: Sequence[AnyTensor], dim: int = 0) -> AnyTensor:
    """Concatenate along ``dim``. Sharded: all split on the same dim (not ``dim``), or all
    replicated, or all unreduced, shard by shard; plain and replicated tensors next to
    split ones are cut locally to match."""


@cat.register(torch.Tensor, variadic=True)
def _cat_torch(tensors, dim=0):
    return torch.cat(list(tensors), dim)


@cat.register(object, variadic=True)
def _cat_sharded(tensors, dim=0):
    tensors = list(tensors)
    ref = next(t for t in tensors if isinstance(t, ShardedTensor))
    d = norm_dim(dim, ref.ndim)
    n = ref.shard_count
    splits = [t for t in tensors if isinstance(t, SplitPrimitiveTensor)]
    kinds = {type(t) for t in tensors if isinstance(t, ShardedTensor)}
    if UnreducedTensor in kinds:
        if kinds != {UnreducedTensor} or any(not isinstance(t, ShardedTensor) for t in tensors):
            raise ShardingError("ops.cat: unreduced tensors can only be concatenated with unreduced tensors")
        return like(ref, [torch.cat(list(row), d) for row in zip(*(t.shards for t in tensors))])
    if not splits:
        cols = [t.shards if isinstance(t, ShardedTensor) else (t,) * n for t in tensors]
        return like(ref, [torch.cat(list(row), d) for row in zip(*cols)])
    sd, sizes = splits[0].shard_dim, splits[0].shard_sizes
    if sd == d:
        raise ShardingError(f"ops.cat along the split dim {d} interleaves shards; all_gather or reshard first")
    cols = []
    for t in tensors:
        if isinstance(t, SplitPrimitiveTensor):
            if (t.shard_dim, t.shard_sizes) != (sd, sizes):
                raise ShardingError(f"ops.cat: split operands disagree: S({sd}) {sizes} vs S({t.shard_dim}) {t.shard_sizes}")
            cols.append(t.shards)
        else:
            shards = t.shards if isinstance(t, ReplicatedTensor) else (t,) * n
            cols.append([s.narrow(sd, o, z) for s, o, z in zip(shards, offsets(sizes), sizes)])
    return split_of([torch.cat(list(row), d) for row in zip(*cols)], sd, ref.devices)
