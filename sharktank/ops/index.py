"""Indexing ops: index_select, take_along_dim, index_put.

Rule: the indexed dims must not be split; a split on any other dim stays split and the op
runs shard by shard. Index tensors are plain or replicated. ``index_put`` is functional
(returns a new tensor), which is what an exported KV cache update needs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..types import QuantizedTensor, ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor
from ._build import ShardingError, like, norm_dim
from ._dispatch import sharded_op

__all__ = ["index_select", "take_along_dim", "index_put"]

AnyTensor = torch.Tensor | ShardedTensor


def _index_shards(index, n: int, op: str):
    if isinstance(index, (SplitPrimitiveTensor, UnreducedTensor)):
        raise ShardingError(f"ops.{op}: index tensors must be replicated or plain, found {index!r}")
    return index.shards if isinstance(index, ReplicatedTensor) else (index,) * n


@sharded_op(nargs=3)
def index_select(t: AnyTensor, dim: int, index: AnyTensor) -> AnyTensor:
    """``torch.index_select``: ``dim`` must not be split; the index is replicated or plain."""


index_select.register(torch.Tensor, int, torch.Tensor)(torch.index_select)


@index_select.register(object, int, object)
def _index_select(t, dim, index):
    if not isinstance(t, ShardedTensor):
        return like(index, [torch.index_select(t, dim, i) for i in _index_shards(index, index.shard_count, "index_select")])
    d = norm_dim(dim, t.ndim)
    if isinstance(t, SplitPrimitiveTensor) and t.shard_dim == d:
        raise ShardingError(
            f"ops.index_select along dim {d} of {list(t.shape)}, which is split {t.shard_sizes}; all_gather or reshard first"
        )
    idx = _index_shards(index, t.shard_count, "index_select")
    return like(t, [select_rows(s, d, i) for s, i in zip(t.shards, idx)])


def select_rows(t, dim: int, index: torch.Tensor):
    """``torch.index_select`` of a plain tensor, or of a :class:`QuantizedTensor` along a dim
    before its last (whole rows of blocks, selected as they are)."""
    if not isinstance(t, QuantizedTensor):
        return torch.index_select(t, dim, index)
    d = norm_dim(dim, t.ndim)
    if d == t.ndim - 1:
        raise ShardingError(f"ops.index_select along the last dim of {t!r}: its values are packed in blocks along it")
    shape = list(t.shape)
    shape[d] = index.shape[0]
    return t.with_blocks(torch.index_select(t.blocks, d, index), shape)


@sharded_op(nargs=2)
def take_along_dim(t: AnyTensor, index: AnyTensor, dim: int) -> AnyTensor:
    """``torch.take_along_dim``: the values of ``t`` at ``index`` along ``dim``. ``index`` has
    ``t``'s rank, and each of its other dims is 1 (broadcast) or ``t``'s size. ``dim`` must not
    be split, and a split dim of ``t`` must have size 1 in ``index``; the index is replicated
    or plain."""


@take_along_dim.register(torch.Tensor, torch.Tensor)
def _take_along_dim_torch(t, index, dim):
    # A gather of the broadcast index: torch.export keeps ``t``'s dims dynamic through it,
    # where take_along_dim's own broadcast specialises them to the example's sizes.
    d = norm_dim(dim, t.ndim)
    shape = list(t.shape)
    shape[d] = index.shape[d]
    return torch.gather(t, d, index.expand(shape))


@take_along_dim.register(object, object)
def _take_along_dim(t, index, dim):
    if not isinstance(t, ShardedTensor):
        return like(index, [_take_along_dim_torch(t, i, dim) for i in _index_shards(index, index.shard_count, "take_along_dim")])
    d = norm_dim(dim, t.ndim)
    if isinstance(t, UnreducedTensor):
        raise ShardingError(f"ops.take_along_dim of an UnreducedTensor {t!r}: all_reduce first")
    if isinstance(t, SplitPrimitiveTensor) and (t.shard_dim == d or index.shape[t.shard_dim] != 1):
        raise ShardingError(
            f"ops.take_along_dim along dim {d} of {list(t.shape)} (split {t.shard_sizes} on dim {t.shard_dim}) with an index "
            f"of shape {list(index.shape)}: the split dim must be another one, of size 1 in the index"
        )
    idx = _index_shards(index, t.shard_count, "take_along_dim")
    return like(t, [_take_along_dim_torch(s, i, d) for s, i in zip(t.shards, idx)])


@sharded_op(nargs=1)
def index_put(t: AnyTensor, indices: Sequence[AnyTensor], values: AnyTensor) -> AnyTensor:
    """A copy of ``t`` with ``t[indices] = values`` (``Tensor.index_put``, not in place).

    ``indices`` index the leading ``len(indices)`` dims, which must not be split. Sharded:
    ``t`` and ``values`` split on the same trailing dim (counted from the end) or both
    replicated; ``values`` may be plain next to a replicated ``t``.
    """


@index_put.register(torch.Tensor)
def _index_put_torch(t, indices, values):
    if isinstance(values, ShardedTensor) or any(isinstance(i, ShardedTensor) for i in indices):
        raise ShardingError("ops.index_put: a plain tensor cannot take sharded indices or values; shard it first")
    return t.index_put(tuple(indices), values)


@index_put.register(ShardedTensor)
def _index_put(t, indices, values):
    op = "index_put"
    n = t.shard_count
    k = len(indices)
    if isinstance(t, UnreducedTensor):
        raise ShardingError(f"ops.{op} into an UnreducedTensor is not linear; all_reduce first")
    if n == 1 and isinstance(values, (SplitPrimitiveTensor, ReplicatedTensor)) and values.shard_count == 1:
        # One shard holds everything: a split dim is only a label (a reshape of a size-1 dim
        # may put it elsewhere, e.g. a single KV head), so the values fit as they are.
        vals = values.shards
    elif isinstance(t, SplitPrimitiveTensor):
        if t.shard_dim < k:
            raise ShardingError(f"ops.{op}: indexed dim {t.shard_dim} of {list(t.shape)} is split; reshard first")
        from_end = t.ndim - t.shard_dim
        ok = isinstance(values, SplitPrimitiveTensor) and values.ndim - values.shard_dim == from_end
        if not ok or values.shard_sizes != t.shard_sizes:
            raise ShardingError(f"ops.{op}: values {values!r} must be split like {t!r} (same trailing dim and sizes)")
        vals = values.shards
    elif isinstance(values, (SplitPrimitiveTensor, UnreducedTensor)):
        raise ShardingError(f"ops.{op}: replicated target with {values!r} values; replicate the values first")
    else:
        vals = values.shards if isinstance(values, ReplicatedTensor) else (values,) * n
    idx = [_index_shards(i, n, op) for i in indices]
    return like(t, [s.index_put(tuple(ii), v) for s, v, *ii in zip(t.shards, vals, *idx)])
