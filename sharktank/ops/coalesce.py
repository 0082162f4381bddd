"""Coalesced transfers: many small tensors crossing devices together travel in flat buckets.

Rule: the tensors that move between the same pair of devices (``transfer_coalesced``), or
are reduced over the same devices (``all_reduce_coalesced``), with the same dtype, are
flattened and concatenated in argument order, and that flat buffer is cut into buckets: a
first bucket of ``first_bucket_bytes``, then buckets of ``bucket_bytes`` (the last may be
smaller; a tensor may straddle two buckets). Each bucket is one transfer per (source,
destination) pair, so ``K`` tensors of ``T`` bytes in total cost :func:`bucket_sizes`
transfers per pair instead of ``K``. Defaults: 1 MiB and 25 MiB, as gradient reducers use.

``all_reduce_coalesced`` pins every packed bucket, and every reduced bucket, to its device
with a barrier (free in eager mode): without them IREE 3.10 folds the slices of a bucket
into the pieces the all_reduce moved, and compiled some programs to wrong results (zeros)
or refused them ("op affinity ... is not compatible with the partition affinity").
``transfer_coalesced`` needs none, and barriers there make that compiler fail.

Results equal the uncoalesced ops bit for bit (an element is summed over the same devices
in the same order). Tensors with a dynamic (symbolic) size are not packed: they take the
uncoalesced path. A shard with no elements is made anew on its destination (no transfer).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..types import ReplicatedTensor, ShardedTensor, UnreducedTensor
from ..types.placement import normalize_devices
from ._build import ShardingError, replicated_of, unreduced_of
from ._dispatch import sharded_op
from ._placement import PlacementError
from ._transfer import barrier_tensor, move_tensor
from .collectives import all_reduce, reduce_scatter_gather

__all__ = ["all_reduce_coalesced", "transfer_coalesced", "bucket_sizes", "BUCKET_BYTES", "FIRST_BUCKET_BYTES"]

BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20


def bucket_sizes(numel: int, itemsize: int, bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[int]:
    """Element counts of the buckets ``numel`` elements of ``itemsize`` bytes are cut into:
    ``first_bucket_bytes`` first, then ``bucket_bytes`` each (a cap below one element holds one).

    >>> bucket_sizes(10, 4, bucket_bytes=16, first_bucket_bytes=8)
    [2, 4, 4]
    """
    if bucket_bytes < 1 or first_bucket_bytes < 1:
        raise ValueError(f"bucket sizes must be positive, found bucket_bytes={bucket_bytes} first_bucket_bytes={first_bucket_bytes}")
    first = max(1, first_bucket_bytes // itemsize)
    if numel <= first:
        return [numel] if numel else []
    cap = max(1, bucket_bytes // itemsize)
    rest = numel - first
    full, last = divmod(rest, cap)
    return [first] + [cap] * full + ([last] if last else [])


def _static(s: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in s.shape)


def _pack(flats: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """The concatenation of 1-D tensors cut into buckets of ``sizes`` elements."""
    flat = torch.cat(flats) if len(flats) > 1 else flats[0]
    return list(torch.split(flat, sizes)) if len(sizes) > 1 else [flat]


def _unpack(buckets: Sequence[torch.Tensor], numels: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack`: flat pieces of ``numels`` elements; a piece inside one
    bucket is a view, one straddling buckets is concatenated."""
    out, b, off = [], 0, 0
    for n in numels:
        parts = []
        while n:
            size = buckets[b].shape[0]
            take = min(n, size - off)
            parts.append(buckets[b][off : off + take] if take < size else buckets[b])
            n, off = n - take, off + take
            if off == size:
                b, off = b + 1, 0
        out.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    return out


def _tensors_key(tensors, *args, **kwargs):
    return tensors


@sharded_op(key=_tensors_key, places_data=True)
def all_reduce_coalesced(
    tensors: Sequence[ShardedTensor],
    *,
    bucket_bytes: int = BUCKET_BYTES,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> list[ReplicatedTensor]:
    """``[ops.all_reduce(t) for t in tensors]`` with the unreduced tensors of one dtype on the
    same devices packed into flat buckets (see :func:`bucket_sizes`): ``2N(N-1)`` transfers
    per bucket (reduce_scatter + all_gather, for two devices too) instead of per tensor,
    each device still sending and receiving ``2(N-1)/N`` of the data. Replicated tensors are returned as they are.
    """


@all_reduce_coalesced.register(ShardedTensor, variadic=True)
def _all_reduce_coalesced(tensors, *, bucket_bytes=BUCKET_BYTES, first_bucket_bytes=FIRST_BUCKET_BYTES):
    tensors = list(tensors)
    out: list = list(tensors)
    groups: dict[tuple, list[int]] = {}
    for k, t in enumerate(tensors):
        if isinstance(t, ReplicatedTensor):
            continue
        if not isinstance(t, UnreducedTensor):
            raise ShardingError(f"ops.all_reduce_coalesced: tensor {k} is {t!r}, not a partial sum; all_gather a split tensor")
        if t.shard_count > 1 and _static(t.shards[0]) and t.shards[0].numel():
            groups.setdefault((t.devices, t.dtype), []).append(k)
        else:
            out[k] = all_reduce(t)
    for (devices, dtype), ks in groups.items():
        numels = [tensors[k].shards[0].numel() for k in ks]
        sizes = bucket_sizes(sum(numels), dtype.itemsize, bucket_bytes, first_bucket_bytes)
        packed = [
            [barrier_tensor(b, d) for b in _pack([tensors[k].shards[i].reshape(-1) for k in ks], sizes)]
            for i, d in enumerate(devices)
        ]
        # reduce_scatter + all_gather even for two devices: IREE 3.10 cannot compile the
        # swap of whole buckets (slices of the packed tensor).
        reduced = [reduce_scatter_gather(unreduced_of([p[b] for p in packed], devices)) for b in range(len(sizes))]
        flats = [_unpack([barrier_tensor(r.shards[i], d) for r in reduced], numels) for i, d in enumerate(devices)]
        for j, k in enumerate(ks):
            t = tensors[k]
            r = replicated_of([f[j].reshape(t.shape) for f in flats], devices)
            out[k] = r.clone(pinned=True) if t.pinned else r
    return out


@sharded_op(key=_tensors_key, places_data=True)
def transfer_coalesced(
    tensors: Sequence[ShardedTensor],
    devices: Sequence[int],
    *,
    bucket_bytes: int = BUCKET_BYTES,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
) -> list[ShardedTensor]:
    """Move shard ``i`` of every tensor to ``devices[i]``, as
    ``[ops.transfer_to_logical_device(t, devices) for t in tensors]`` but with the shards that
    go from one device to another (of one dtype) packed into flat buckets (see
    :func:`bucket_sizes`): one transfer per bucket per (source, destination) pair. Each
    result keeps its tensor's type, placement and pinned flag; shards already in place stay.
    """


@transfer_coalesced.register(ShardedTensor, variadic=True)
def _transfer_coalesced(tensors, devices, *, bucket_bytes=BUCKET_BYTES, first_bucket_bytes=FIRST_BUCKET_BYTES):
    tensors = list(tensors)
    if isinstance(devices, int):
        raise TypeError(f"ops.transfer_coalesced needs one device per shard, found {devices}")
    devices = tuple(devices)
    devices = normalize_devices(devices, len(devices))
    moves: dict[tuple, list[tuple[int, int]]] = {}
    shards = [list(t.shards) for t in tensors]
    for k, t in enumerate(tensors):
        if t.shard_count != len(devices):
            raise PlacementError(f"ops.transfer_coalesced: tensor {k} {t!r} has {t.shard_count} shards, devices {list(devices)}")
        for i, (s, src, dst) in enumerate(zip(t.shards, t.devices, devices)):
            if src == dst:
                continue
            if not _static(s):
                shards[k][i] = move_tensor(s, src, dst)
            elif s.numel():
                moves.setdefault((src, dst, s.dtype), []).append((k, i))
            else:
                shards[k][i] = torch.zeros(s.shape, dtype=s.dtype, device=s.device)
    for (src, dst, dtype), items in moves.items():
        parts = [tensors[k].shards[i] for k, i in items]
        numels = [p.numel() for p in parts]
        sizes = bucket_sizes(sum(numels), dtype.itemsize, bucket_bytes, first_bucket_bytes)
        moved = [move_tensor(b, src, dst) for b in _pack([p.reshape(-1) for p in parts], sizes)]
        for (k, i), p, flat in zip(items, parts, _unpack(moved, numels)):
            shards[k][i] = flat.reshape(p.shape)
    return [t.clone(ts=tuple(s), devices=devices) for t, s in zip(tensors, shards)]
