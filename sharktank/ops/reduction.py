"""Reductions: sum, mean, argmax.

Rule: reducing dims that are not split keeps the split (shard by shard). ``sum``/``mean``
over a split dim give an unreduced result (each shard's partial sum; for ``mean`` each
shard divides by the global count). Unreduced inputs reduce shard by shard (linear).
``argmax`` over a split dim gathers first (``all_gather``: visible in
``record_transfers``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..types import ShardedTensor, SplitPrimitiveTensor, UnreducedTensor
from ._build import like, norm_dim, split_of, unreduced_of
from ._dispatch import sharded_op

__all__ = ["sum", "mean", "argmax"]

AnyTensor = torch.Tensor | ShardedTensor
Dims = int | Sequence[int] | None


def _dims(dim: Dims, rank: int) -> list[int]:
    if dim is None:
        return list(range(rank))
    if isinstance(dim, int):
        dim = [dim]
    return sorted({norm_dim(d, rank) for d in dim})


def _new_split_dim(split_dim: int, dims: list[int], keepdim: bool) -> int:
    return split_dim if keepdim else split_dim - len([d for d in dims if d < split_dim])


def _reduce(t: ShardedTensor, dim: Dims, keepdim: bool, mean: bool):
    dims = _dims(dim, t.ndim)
    count = 1
    for d in dims:
        count *= t.shape[d]

    def local(s):
        if not dims:
            return s.clone()
        r = torch.sum(s, dim=dims, keepdim=keepdim)
        return r / count if mean else r

    out = [local(s) for s in t.shards]
    if isinstance(t, SplitPrimitiveTensor):
        if t.shard_dim in dims:
            return unreduced_of(out, t.devices)
        return split_of(out, _new_split_dim(t.shard_dim, dims, keepdim), t.devices)
    return like(t, out)


@sharded_op()
def sum(t: AnyTensor, dim: Dims = None, keepdim: bool = False) -> AnyTensor:
    """Sum over ``dim`` (all dims when None). Over a split dim the result is unreduced."""


@sum.register(torch.Tensor)
def _sum_torch(t, dim=None, keepdim=False):
    return torch.sum(t) if dim is None else torch.sum(t, dim=dim, keepdim=keepdim)


sum.register(ShardedTensor)(lambda t, dim=None, keepdim=False: _reduce(t, dim, keepdim, mean=False))


@sharded_op()
def mean(t: AnyTensor, dim: Dims = None, keepdim: bool = False) -> AnyTensor:
    """Mean over ``dim`` (all dims when None). Over a split dim the result is unreduced."""


@mean.register(torch.Tensor)
def _mean_torch(t, dim=None, keepdim=False):
    return torch.mean(t) if dim is None else torch.mean(t, dim=dim, keepdim=keepdim)


mean.register(ShardedTensor)(lambda t, dim=None, keepdim=False: _reduce(t, dim, keepdim, mean=True))


@sharded_op()
def argmax(t: AnyTensor, dim: int, keepdim: bool = False) -> AnyTensor:
    """Index of the largest value along ``dim``. A split ``dim`` is gathered first."""


argmax.register(torch.Tensor)(lambda t, dim, keepdim=False: torch.argmax(t, dim=dim, keepdim=keepdim))


@argmax.register(ShardedTensor)
def _argmax(t, dim, keepdim=False):
    from .collectives import all_gather, all_reduce

    d = norm_dim(dim, t.ndim)
    if isinstance(t, UnreducedTensor):
        t = all_reduce(t)
    elif isinstance(t, SplitPrimitiveTensor) and t.shard_dim == d:
        t = all_gather(t)
    out = [torch.argmax(s, dim=d, keepdim=keepdim) for s in t.shards]
    if isinstance(t, SplitPrimitiveTensor):
        return split_of(out, _new_split_dim(t.shard_dim, [d], keepdim), t.devices)
    return like(t, out)
