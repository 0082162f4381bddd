"""Small helpers the op implementations share: building results and slicing operands."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from ..types import ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor

__all__ = [
    "ShardingError",
    "split_of",
    "replicated_of",
    "unreduced_of",
    "like",
    "offsets",
    "slice_pieces",
    "norm_dim",
]


class ShardingError(ValueError):
    """An op cannot compute its result for these placements (it says which, and what to do)."""


def split_of(shards: Sequence[torch.Tensor], dim: int, devices: tuple[int, ...]) -> SplitPrimitiveTensor:
    shards = tuple(shards)
    shape = list(shards[0].shape)
    shape[dim] = sum([s.shape[dim] for s in shards])
    return SplitPrimitiveTensor._make(shards, devices, torch.Size(shape), dim)


def replicated_of(shards: Sequence[torch.Tensor], devices: tuple[int, ...]) -> ReplicatedTensor:
    shards = tuple(shards)
    return ReplicatedTensor._make(shards, devices, shards[0].shape)


def unreduced_of(shards: Sequence[torch.Tensor], devices: tuple[int, ...]) -> UnreducedTensor:
    shards = tuple(shards)
    return UnreducedTensor._make(shards, devices, shards[0].shape)


def like(t: ShardedTensor, shards: Sequence[torch.Tensor], split_dim: int | None = None) -> ShardedTensor:
    """A result of ``t``'s type on ``t``'s devices (a split result may name a new dim)."""
    if isinstance(t, SplitPrimitiveTensor):
        return split_of(shards, t.shard_dim if split_dim is None else split_dim, t.devices)
    if isinstance(t, ReplicatedTensor):
        return replicated_of(shards, t.devices)
    return unreduced_of(shards, t.devices)


def offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)][:-1]


def slice_pieces(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Views of ``x`` cut along ``dim`` into pieces of ``sizes`` (a local slice, no transfer)."""
    if sum(sizes) != x.shape[dim]:
        raise ShardingError(f"cannot cut dim {dim} of size {x.shape[dim]} into pieces {list(sizes)}")
    return list(torch.split(x, list(sizes), dim=dim))


def cut_like_split(shards: Sequence[torch.Tensor], dim: int, sizes: Sequence[int], op: str) -> list[torch.Tensor]:
    """Per-shard pieces of a broadcast operand (replicated or plain: ``shards`` hold the whole
    value) next to an operand split into ``sizes`` along the aligned ``dim``.

    A dim of the split's total size is cut locally (no transfer); a size-1 or missing dim
    broadcasts and is not cut. Anything else would broadcast the split dim itself, which the
    shards cannot do locally: ShardingError.
    """
    n = len(sizes)
    if dim < 0:
        return list(shards)
    size, total = shards[0].shape[dim], sum(sizes)
    if size == total:
        return [s.narrow(dim, o, z) for s, o, z in zip(shards, offsets(sizes), sizes)]
    if size == 1:
        return list(shards)
    raise ShardingError(
        f"ops.{op}: an operand of size {size} along the split dim broadcasts against a split "
        f"dim of size {total} (split {list(sizes)} over {n} shards); replicate the split operand first"
    )


def norm_dim(dim: int, rank: int) -> int:
    if not -rank <= dim < max(rank, 1):
        raise IndexError(f"dim {dim} is out of range for a tensor of rank {rank}")
    return dim % rank if rank else 0
