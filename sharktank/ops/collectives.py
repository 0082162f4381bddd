"""Collectives and explicit data placement.

Transfer counts and bytes for ``N`` shards of a tensor of ``B`` bytes (``B/N`` a shard);
every transfer is recorded by :func:`record_transfers`. No collective routes data through
one device:

- ``all_gather``: every device sends its shard straight to every other device:
  ``N(N-1)`` transfers; each device sends and receives ``(N-1)/N · B``.
- ``reduce_scatter``: shard ``i`` of every device goes to device ``i``, which sums them:
  ``N(N-1)`` transfers; each device sends and receives ``(N-1)/N · B``.
- ``all_reduce``: ``reduce_scatter`` over the flattened tensor, then ``all_gather`` of the
  reduced pieces: ``2N(N-1)`` transfers; each device sends and receives
  ``2(N-1)/N · B`` (the bandwidth-optimal figure). Two devices swap whole shards: 2
  transfers of ``B``, the same bytes in one round. Pieces with no elements (a tensor
  with fewer than ``N`` elements) are not sent.
- ``sharded_cat`` / ``sharded_sum`` / ``unshard``: the ``N-1`` shards not on the root
  device go to it: ``N-1`` transfers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..types import (
    Partial,
    QuantizedTensor,
    Replicate,
    ReplicatedTensor,
    ShardedTensor,
    ShardingSpec,
    Split,
    SplitPrimitiveTensor,
    UnreducedTensor,
    split_sizes,
)
from ._build import ShardingError, norm_dim, replicated_of, split_of, unreduced_of
from ._dispatch import sharded_op
from ._placement import move_shards
from ._transfer import barrier_tensor, move_tensor

__all__ = [
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "replicate",
    "reshard_split",
    "reshard",
    "reshard_like",
    "unshard",
    "sharded_cat",
    "sharded_sum",
    "transfer_to_logical_device",
    "barrier_on_logical_device",
    "equal",
]

AnyTensor = torch.Tensor | ShardedTensor


def _gather_pieces(pieces: Sequence[torch.Tensor], devices: tuple[int, ...], dim: int) -> list[torch.Tensor]:
    """Every device receives every other device's piece and concatenates them in order."""
    out = []
    for j, dst in enumerate(devices):
        local = [p if i == j else move_tensor(p, devices[i], dst) for i, p in enumerate(pieces) if p.numel() or i == j]
        out.append(torch.cat(local, dim=dim) if len(local) > 1 else local[0])
    return out


def _scatter_reduce(parts: Sequence[Sequence[torch.Tensor]], devices: tuple[int, ...]) -> list[torch.Tensor]:
    """``parts[i][j]`` is device i's piece j; device j receives piece j from everyone and sums
    them in device order (so every device computes its piece identically)."""
    out = []
    for j, dst in enumerate(devices):
        acc = None
        for i, src in enumerate(devices):
            p = parts[i][j]
            if i != j and p.numel():
                p = move_tensor(p, src, dst)
            acc = p if acc is None else acc + p
        out.append(acc)
    return out


@sharded_op(places_data=True)
def all_gather(t: AnyTensor, dim: int | None = None) -> ReplicatedTensor:
    """Gather a split tensor onto every device: a replicated tensor of the whole value.

    ``dim`` defaults to the split dim (concatenating along another dim gives a different
    tensor: that is the caller's intent). ``N(N-1)`` direct transfers; each device sends and
    receives ``(N-1)/N`` of the tensor. A replicated input is returned as is.
    """


@all_gather.register(SplitPrimitiveTensor)
def _all_gather_split(t: SplitPrimitiveTensor, dim=None):
    d = t.shard_dim if dim is None else norm_dim(dim, t.ndim)
    out = replicated_of(_gather_pieces(t.shards, t.devices, d), t.devices)
    return out.clone(pinned=True) if t.pinned else out


@all_gather.register(ReplicatedTensor)
def _all_gather_replicated(t, dim=None):
    return t


@sharded_op(places_data=True)
def all_reduce(t: AnyTensor) -> ReplicatedTensor:
    """Sum the partial sums of an unreduced tensor onto every device, as ``reduce_scatter``
    + ``all_gather`` over the flattened value.

    ``2N(N-1)`` transfers of ``1/N`` of the tensor; each device sends and receives
    ``2(N-1)/N`` of it. Two devices swap their whole shards instead: the same bytes (one
    tensor each way) in 2 transfers and one round. Every device adds the partial sums in
    device order, so all replicas are identical. A replicated input is returned as is.
    """


@all_reduce.register(UnreducedTensor)
def _all_reduce_unreduced(t):
    n, devices = t.shard_count, t.devices
    if n == 1:
        out = replicated_of(t.shards, devices)
    elif n == 2:
        out = replicated_of(_scatter_reduce([[s, s] for s in t.shards], devices), devices)
    else:
        out = reduce_scatter_gather(t)
    return out.clone(pinned=True) if t.pinned else out


def reduce_scatter_gather(t: UnreducedTensor) -> ReplicatedTensor:
    """``all_reduce`` as reduce_scatter + all_gather for any N >= 2 (unpinned result)."""
    n, devices = t.shard_count, t.devices
    shape = t.shards[0].shape
    if all(isinstance(d, int) for d in shape):
        sizes = split_sizes(t.shards[0].numel(), n)
        parts = [torch.split(s.reshape(-1), sizes) for s in t.shards]
        reduced = _scatter_reduce(parts, devices)
        out = replicated_of([g.reshape(shape) for g in _gather_pieces(reduced, devices, 0)], devices)
    else:
        # Symbolic sizes (tracing with dynamic dims): scatter along the last static dim.
        d = max((i for i, x in enumerate(shape) if isinstance(x, int)), default=None)
        if d is None:
            raise ShardingError(f"ops.all_reduce: every dim of {list(shape)} is dynamic; cannot cut pieces")
        sizes = split_sizes(shape[d], n)
        parts = [torch.split(s, sizes, dim=d) for s in t.shards]
        out = replicated_of(_gather_pieces(_scatter_reduce(parts, devices), devices, d), devices)
    return out


@all_reduce.register(ReplicatedTensor)
def _all_reduce_replicated(t):
    return t


@sharded_op(places_data=True)
def reduce_scatter(t: AnyTensor, scatter_dim: int) -> SplitPrimitiveTensor:
    """Sum an unreduced tensor and leave piece ``i`` of the sum on device ``i``, split along
    ``scatter_dim`` with ``torch.tensor_split`` sizes. ``N(N-1)`` transfers; each device sends
    and receives ``(N-1)/N`` of the tensor.
    """


@reduce_scatter.register(UnreducedTensor)
def _reduce_scatter(t, scatter_dim):
    d = norm_dim(scatter_dim, t.ndim)
    sizes = split_sizes(t.shape[d], t.shard_count)
    parts = [torch.split(s, sizes, dim=d) for s in t.shards]
    out = split_of(_scatter_reduce(parts, t.devices), d, t.devices)
    return out.clone(pinned=True) if t.pinned else out


def _devices_arg(count: int | None, devices: Sequence[int] | None, what: str) -> tuple[int, ...]:
    spec = ShardingSpec(Replicate(), tuple(devices) if devices is not None else tuple(range(_need(count, what))))
    if count is not None and count != spec.shard_count:
        raise ValueError(f"ops.{what}: count={count} does not match devices {list(spec.devices)}")
    return spec.devices


def _need(count, what):
    if count is None:
        raise ValueError(f"ops.{what}: give count or devices")
    return count


@sharded_op(places_data=True)
def replicate(t: AnyTensor, count: int | None = None, devices: Sequence[int] | None = None, pinned: bool = False) -> ReplicatedTensor:
    """A replicated tensor with ``count`` shards on ``devices`` (default ``0..count-1``).

    A plain tensor is transferred to each device (``count`` transfers from the host). A
    replicated input keeps the replicas already on ``devices`` and copies one to each other
    device (so a one-shard tensor is broadcast from its device). A split or unreduced input
    is gathered or reduced in place (``all_gather``/``all_reduce``) and then moved to
    ``devices`` if they differ. Autograd: the gradient of the input is the sum of the
    replicas' gradients.
    """


@replicate.register(torch.Tensor)
def _replicate_torch(t, count=None, devices=None, pinned=False):
    devs = _devices_arg(count, devices, "replicate")
    return ReplicatedTensor(ts=[move_tensor(t, None, d) for d in devs], devices=devs, pinned=pinned)


@replicate.register(ShardedTensor)
def _replicate_sharded(t, count=None, devices=None, pinned=False):
    devs = t.devices if devices is None and count in (None, t.shard_count) else _devices_arg(count, devices, "replicate")
    if isinstance(t, ReplicatedTensor):
        held = dict(zip(t.devices, t.shards))
        n = t.shard_count
        shards = [
            held[d] if d in held else move_tensor(t.shards[i % n], t.devices[i % n], d) for i, d in enumerate(devs)
        ]
        return replicated_of(shards, devs).clone(pinned=pinned)
    if len(devs) != t.shard_count:
        raise ShardingError(f"ops.replicate: {t!r} has {t.shard_count} shards, asked for {len(devs)}; unshard first")
    r = all_reduce(t) if isinstance(t, UnreducedTensor) else all_gather(t)
    return move_shards(r, devs, pinned)


@sharded_op(places_data=True)
def reshard_split(t: AnyTensor, *, dim: int, count: int | None = None, devices: Sequence[int] | None = None, pinned: bool = False) -> SplitPrimitiveTensor:
    """Split ``t`` along ``dim`` into ``count`` shards on ``devices``.

    Plain tensor: each piece is transferred to its device. Replicated: each device keeps its
    own piece (no transfer). Split on ``dim`` already: returned (moved if ``devices``
    differ). Split on another dim: ``all_gather`` then local pieces. Unreduced:
    ``reduce_scatter``.
    """


@reshard_split.register(torch.Tensor)
def _reshard_split_torch(t, *, dim, count=None, devices=None, pinned=False):
    devs = _devices_arg(count, devices, "reshard_split")
    d = norm_dim(dim, t.ndim)
    pieces = torch.split(t, split_sizes(t.shape[d], len(devs)), dim=d)
    return SplitPrimitiveTensor(shard_dim=d, ts=[move_tensor(p, None, dv) for p, dv in zip(pieces, devs)], devices=devs, pinned=pinned)


@reshard_split.register(ShardedTensor)
def _reshard_split_sharded(t, *, dim, count=None, devices=None, pinned=False):
    devs = t.devices if devices is None and count in (None, t.shard_count) else _devices_arg(count, devices, "reshard_split")
    if len(devs) != t.shard_count:
        raise ShardingError(f"ops.reshard_split: {t!r} has {t.shard_count} shards, asked for {len(devs)}; unshard first")
    d = norm_dim(dim, t.ndim)
    if isinstance(t, UnreducedTensor):
        out = reduce_scatter(t, d)
    elif isinstance(t, SplitPrimitiveTensor) and t.shard_dim == d:
        out = t
    else:
        full = t if isinstance(t, ReplicatedTensor) else all_gather(t)
        sizes = split_sizes(t.shape[d], t.shard_count)
        out = split_of([torch.split(s, sizes, dim=d)[i] for i, s in enumerate(full.shards)], d, t.devices)
    return move_shards(out, devs, pinned)


@sharded_op(places_data=True)
def reshard(t: AnyTensor, spec: ShardingSpec) -> ShardedTensor:
    """Bring ``t`` to the placement, devices and pinned flag of ``spec``
    (a :class:`sharktank.types.ShardingSpec`, e.g. ``ShardingSpec.split(1, devices=[4, 5])``).
    """


@reshard.register(object)
def _reshard(t, spec: ShardingSpec):
    p = spec.placement
    if isinstance(p, Split):
        return reshard_split(t, dim=p.dim, devices=spec.devices, pinned=spec.pinned)
    if isinstance(p, Replicate):
        return replicate(t, devices=spec.devices, pinned=spec.pinned)
    if isinstance(p, Partial):
        raise ShardingError("ops.reshard: an unreduced placement cannot be produced from a value; use a split or replicated spec")
    raise TypeError(f"ops.reshard: expected a ShardingSpec, found {spec!r}")


@sharded_op(nargs=2, places_data=True)
def reshard_like(t: AnyTensor, like: ShardedTensor) -> ShardedTensor:
    """Bring ``t`` to ``like``'s placement, devices and pinned flag (see :func:`reshard`)."""


@reshard_like.register(object, ShardedTensor)
def _reshard_like(t, like):
    return reshard(t, like.spec)


def _gather_to_root(t: ShardedTensor, root: int) -> list[torch.Tensor]:
    dst = t.devices[root]
    return [s if i == root else move_tensor(s, t.devices[i], dst) for i, s in enumerate(t.shards)]


@sharded_op(places_data=True)
def sharded_cat(t: SplitPrimitiveTensor, root: int = 0) -> torch.Tensor:
    """Concatenate the shards of a split tensor on the device of shard ``root``: a plain
    tensor holding the whole value. ``N-1`` transfers."""


@sharded_cat.register(SplitPrimitiveTensor)
def _sharded_cat(t, root=0):
    return torch.cat(_gather_to_root(t, root), dim=t.shard_dim)


@sharded_op(places_data=True)
def sharded_sum(t: UnreducedTensor, root: int = 0) -> torch.Tensor:
    """Sum the partial sums of an unreduced tensor on the device of shard ``root``: a plain
    tensor. ``N-1`` transfers."""


@sharded_sum.register(UnreducedTensor)
def _sharded_sum(t, root=0):
    pieces = _gather_to_root(t, root)
    acc = pieces[0]
    for p in pieces[1:]:
        acc = acc + p
    return acc


@sharded_op(places_data=True)
def unshard(t: AnyTensor) -> torch.Tensor:
    """The whole value as a plain tensor: split → :func:`sharded_cat`, replicated → shard 0,
    unreduced → :func:`sharded_sum`; a plain tensor is returned as is."""


unshard.register(torch.Tensor)(lambda t: t)
unshard.register(SplitPrimitiveTensor)(
    lambda t: QuantizedTensor.cat(list(t.shards), t.shard_dim) if isinstance(t.shards[0], QuantizedTensor) else sharded_cat(t)
)
unshard.register(ReplicatedTensor)(lambda t: t.shards[0])
unshard.register(UnreducedTensor)(lambda t: sharded_sum(t))


@sharded_op(places_data=True)
def transfer_to_logical_device(t: AnyTensor, device: int | Sequence[int]) -> AnyTensor:
    """Move data to logical devices: a real transfer in eager mode (a copy) and in export
    (``flow.tensor.transfer``), recorded by :func:`record_transfers`.

    A plain tensor goes to ``device`` (an int). A sharded tensor takes a sequence with one
    device per shard and keeps its pinned flag; shards already in place are not copied.
    """


@transfer_to_logical_device.register(torch.Tensor)
def _transfer_torch(t, device):
    if not isinstance(device, int):
        raise TypeError(f"ops.transfer_to_logical_device of a plain tensor takes one int device, found {device!r}")
    return move_tensor(t, None, device)


@transfer_to_logical_device.register(ShardedTensor)
def _transfer_sharded(t, device):
    if isinstance(device, int):
        raise TypeError(
            f"ops.transfer_to_logical_device of a {t.shard_count}-shard tensor needs one device per shard, found {device}"
        )
    devs = ShardingSpec(t.placement, tuple(device)).devices
    return move_shards(t, devs)


@sharded_op(places_data=True)
def barrier_on_logical_device(t: AnyTensor, device: int | None = None) -> AnyTensor:
    """Pin a value to a logical device in an exported program without moving it
    (``flow.tensor.barrier``; identity in eager mode). A sharded tensor puts each shard on
    its own device (``device`` must be None)."""


@barrier_on_logical_device.register(torch.Tensor)
def _barrier_torch(t, device=None):
    if device is None:
        raise TypeError("ops.barrier_on_logical_device of a plain tensor needs a device")
    return barrier_tensor(t, device)


@barrier_on_logical_device.register(ShardedTensor)
def _barrier_sharded(t, device=None):
    if device is not None:
        raise TypeError("ops.barrier_on_logical_device of a sharded tensor uses each shard's own device; pass no device")
    return t.clone(ts=[barrier_tensor(s, d) for s, d in zip(t.shards, t.devices)])


@sharded_op(nargs=2, places_data=True)
def equal(a: AnyTensor, b: AnyTensor) -> bool:
    """True when ``a`` and ``b`` hold the same values, whatever their sharding and devices
    (compare placement too with :func:`sharktank.types.is_deep_equal`)."""


@equal.register(object, object)
def _equal(a, b):
    x, y = _host(a), _host(b)
    return x.shape == y.shape and bool(torch.equal(x, y))


def _host(t):
    # Reading for comparison is not a device transfer: nothing is recorded.
    if isinstance(t, SplitPrimitiveTensor):
        return torch.cat(t.shards, dim=t.shard_dim)
    if isinstance(t, ReplicatedTensor):
        return t.shards[0]
    if isinstance(t, UnreducedTensor):
        return sum(t.shards[1:], t.shards[0])
    return t
