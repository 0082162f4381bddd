"""Sharded tensor types: global shape + placement + devices + shards.

The types only hold and validate data. Everything that computes (arithmetic, reshapes,
moves between devices) lives in :mod:`sharktank.ops`; the operator methods here call it
through a late import so that this layer never imports the ops at module level.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .placement import Partial, Placement, Replicate, ShardingSpec, Split, normalize_devices, split_sizes
from .quantized import QuantizedTensor

__all__ = ["ShardedTensor", "SplitPrimitiveTensor", "ReplicatedTensor", "UnreducedTensor", "split_sizes_of"]

_ops_module = None


def _ops():
    # Late import: the types layer must not import ops at module level.
    global _ops_module
    if _ops_module is None:
        from .. import ops

        _ops_module = ops
    return _ops_module


def _as_shard_tuple(ts: Sequence[torch.Tensor], kind: str) -> tuple[torch.Tensor, ...]:
    shards = tuple(ts)
    if not shards:
        raise ValueError(f"{kind} needs at least one shard")
    quantized = isinstance(shards[0], QuantizedTensor)
    for s in shards:
        if not isinstance(s, QuantizedTensor if quantized else torch.Tensor):
            want = "QuantizedTensor (like shard 0)" if quantized else "torch.Tensor or QuantizedTensor"
            raise TypeError(f"{kind} shards must be {want}, found {type(s).__name__}")
    dtype = shards[0].dtype
    if any(s.dtype != dtype for s in shards):
        raise ValueError(f"{kind} shards must share one dtype, found {[s.dtype for s in shards]}")
    if quantized and any(s.layout != shards[0].layout for s in shards):
        raise ValueError(f"{kind} shards must share one quantization, found {[s.layout.name for s in shards]}")
    return shards


def split_sizes_of(t: torch.Tensor | QuantizedTensor, dim: int, count: int, name: str | None = None) -> list[int]:
    """Sizes of ``count`` consecutive pieces of ``t`` along ``dim``: ``torch.tensor_split``'s
    (the first ``size % count`` one larger), counted in whole blocks along a quantized tensor's
    last dim (:meth:`QuantizedTensor.split_sizes`: uneven where an even cut would fall inside a
    block, refused with fewer blocks than pieces)."""
    if isinstance(t, QuantizedTensor):
        return t.split_sizes(dim, count, name)
    return split_sizes(t.shape[dim], count)


def _whole(ts) -> bool:
    """One tensor to split or place (a plain or quantized tensor), not a list of shards."""
    return isinstance(ts, (torch.Tensor, QuantizedTensor))


class ShardedTensor:
    """A tensor held as shards, one per logical device.

    Attributes: ``shards`` (tuple of torch tensors, or of :class:`QuantizedTensor` for a
    quantized weight: split on rows at any count, on the last dim at whole blocks, or
    replicated), ``shard_count``, ``shape`` (global),
    ``dtype``, ``devices`` (one int logical device per shard), ``pinned`` (whether the
    tensor must stay on its devices: see :func:`sharktank.ops.transfer_if_needed`),
    ``placement`` and ``name``.
    """

    __slots__ = ("_shards", "_devices", "_pinned", "_shape", "name")

    _shards: tuple[torch.Tensor, ...]
    _devices: tuple[int, ...]
    _pinned: bool
    _shape: torch.Size
    name: str | None

    def __init__(self, shards, devices, pinned, shape, name):
        # Subclasses validate; this only stores.
        self._shards = shards
        self._devices = normalize_devices(devices, len(shards))
        self._pinned = bool(pinned)
        self._shape = shape
        self.name = name

    @classmethod
    def _make(cls, shards: tuple, devices: tuple[int, ...], shape: torch.Size, shard_dim: int | None = None) -> "ShardedTensor":
        """Trusted constructor for ops (hot path): no validation, unpinned, unnamed."""
        self = object.__new__(cls)
        self._shards = shards
        self._devices = devices
        self._pinned = False
        self._shape = shape
        self.name = None
        if shard_dim is not None:
            self.shard_dim = shard_dim
        return self

    # --- metadata -------------------------------------------------------------------------
    @property
    def shards(self) -> tuple[torch.Tensor, ...]:
        return self._shards

    @property
    def shard_count(self) -> int:
        return len(self._shards)

    @property
    def devices(self) -> tuple[int, ...]:
        return self._devices

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self._shards[0].dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    @property
    def placement(self) -> Placement:
        raise NotImplementedError

    @property
    def spec(self) -> ShardingSpec:
        """Placement, devices and pinned flag as one immutable value."""
        return ShardingSpec(self.placement, self._devices, self._pinned)

    def clone(self, **changes: Any) -> "ShardedTensor":
        """A copy with changed metadata, e.g. ``devices=``, ``pinned=``, ``name=``, ``ts=``.

        This relabels; it never moves data. A clone with other ``devices`` claims the
        same shards now live elsewhere, with no transfer made or recorded. To move data
        use :func:`sharktank.ops.transfer_to_logical_device` or let the dispatcher's
        transfer-if-needed step do it.
        """
        kwargs = self._init_kwargs()
        unknown = set(changes) - set(kwargs)
        if unknown:
            raise TypeError(f"{type(self).__name__}.clone() got unknown fields {sorted(unknown)}; known: {sorted(kwargs)}")
        kwargs.update(changes)
        return type(self)(**kwargs)

    def _init_kwargs(self) -> dict[str, Any]:
        return dict(ts=self._shards, devices=self._devices, pinned=self._pinned, name=self.name)

    def is_deep_equal(self, other: Any, *, compare_placement: bool = True) -> bool:
        """:func:`sharktank.types.is_deep_equal` of ``self`` and ``other`` (as the public
        sharktank package spells it, a method)."""
        from .equality import is_deep_equal  # equality imports this module

        return is_deep_equal(self, other, compare_placement=compare_placement)

    def __repr__(self) -> str:
        pin = ", pinned" if self._pinned else ""
        name = f" {self.name!r}" if self.name else ""
        return (
            f"{type(self).__name__}{name}(shape={list(self._shape)}, {self.placement}, "
            f"devices={list(self._devices)}{pin}, dtype={self.dtype})"
        )

    def __len__(self) -> int:
        return self._shape[0]

    # Sharded tensors are not hashable by value and must not be used as booleans.
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise TypeError("the truth value of a ShardedTensor is ambiguous; use ops.equal or unshard it")

    # --- ops through sharktank.ops ------------------------------------------------------
    @property
    def T(self) -> "ShardedTensor":
        if self.ndim != 2:
            raise ValueError(f".T expects a 2-D tensor, found shape {list(self._shape)}")
        return _ops().transpose(self, 0, 1)

    def transpose(self, dim0: int, dim1: int) -> "ShardedTensor":
        return _ops().transpose(self, dim0, dim1)

    def permute(self, *dims) -> "ShardedTensor":
        return _ops().permute(self, _flat_ints(dims))

    def reshape(self, *shape) -> "ShardedTensor":
        return _ops().reshape(self, _flat_ints(shape))

    def view(self, *shape) -> "ShardedTensor":
        return _ops().view(self, _flat_ints(shape))

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> "ShardedTensor":
        return _ops().flatten(self, start_dim, end_dim)

    def unflatten(self, dim: int, sizes: Sequence[int]) -> "ShardedTensor":
        return _ops().unflatten(self, dim, sizes)

    def expand(self, *shape) -> "ShardedTensor":
        return _ops().expand(self, _flat_ints(shape))

    def to(self, *args, **kwargs) -> "ShardedTensor":
        return _ops().to(self, *args, **kwargs)

    def sum(self, dim=None, keepdim: bool = False):
        return _ops().sum(self, dim, keepdim=keepdim)

    def mean(self, dim=None, keepdim: bool = False):
        return _ops().mean(self, dim, keepdim=keepdim)

    def softmax(self, dim: int):
        return _ops().softmax(self, dim)

    def argmax(self, dim: int, keepdim: bool = False):
        return _ops().argmax(self, dim, keepdim=keepdim)

    def __add__(self, other):
        return _ops().add(self, other)

    def __radd__(self, other):
        return _ops().add(other, self)

    def __sub__(self, other):
        return _ops().sub(self, other)

    def __rsub__(self, other):
        return _ops().sub(other, self)

    def __mul__(self, other):
        return _ops().mul(self, other)

    def __rmul__(self, other):
        return _ops().mul(other, self)

    def __truediv__(self, other):
        return _ops().div(self, other)

    def __rtruediv__(self, other):
        return _ops().div(other, self)

    def __neg__(self):
        return _ops().mul(self, -1)

    def __matmul__(self, other):
        return _ops().matmul(self, other)

    def __rmatmul__(self, other):
        return _ops().matmul(other, self)


def _flat_ints(dims) -> list[int]:
    if len(dims) == 1 and isinstance(dims[0], (list, tuple, torch.Size)):
        return list(dims[0])
    return list(dims)


class SplitPrimitiveTensor(ShardedTensor):
    """Shards are consecutive pieces of the global tensor along ``shard_dim``.

    ``ts`` is a list of shards (they may differ in size along ``shard_dim``; all other
    dims must agree), or one tensor split into ``shard_count`` pieces of
    :func:`split_sizes_of` sizes (``torch.tensor_split``'s, in whole blocks along a quantized
    tensor's last dim).
    """

    __slots__ = ("shard_dim", "_sizes")

    def __init__(
        self,
        *,
        shard_dim: int,
        ts: Sequence[torch.Tensor] | torch.Tensor,
        shard_count: int | None = None,
        devices: Sequence[int] | None = None,
        pinned: bool = False,
        name: str | None = None,
    ):
        if _whole(ts):
            if shard_count is None:
                shard_count = len(devices) if devices is not None else None
            if shard_count is None:
                raise ValueError("SplitPrimitiveTensor from one tensor needs shard_count or devices")
            dim = _norm_dim(shard_dim, ts.ndim, "shard_dim")
            ts = ts.split(split_sizes_of(ts, dim, shard_count, name), dim)
        shards = _as_shard_tuple(ts, "SplitPrimitiveTensor")
        if shard_count is not None and shard_count != len(shards):
            raise ValueError(f"shard_count={shard_count} but {len(shards)} shards were given")
        rank = shards[0].ndim
        dim = _norm_dim(shard_dim, rank, "shard_dim")
        ref = list(shards[0].shape)
        for i, s in enumerate(shards):
            other = list(s.shape)
            if len(other) != rank or other[:dim] + other[dim + 1 :] != ref[:dim] + ref[dim + 1 :]:
                raise ValueError(
                    f"split shards must agree on every dim but shard_dim={dim}: "
                    f"shard 0 has shape {ref}, shard {i} has shape {other}"
                )
        shape = list(ref)
        shape[dim] = sum(s.shape[dim] for s in shards)
        self.shard_dim = dim
        super().__init__(shards, devices, pinned, torch.Size(shape), name)

    @property
    def placement(self) -> Placement:
        return Split(self.shard_dim)

    @property
    def shard_sizes(self) -> list[int]:
        """Sizes of the shards along ``shard_dim`` (a new list each time)."""
        try:
            sizes = self._sizes
        except AttributeError:
            d = self.shard_dim
            sizes = self._sizes = tuple([s.shape[d] for s in self._shards])
        return list(sizes)

    def _init_kwargs(self) -> dict[str, Any]:
        kw = super()._init_kwargs()
        kw["shard_dim"] = self.shard_dim
        return kw


class ReplicatedTensor(ShardedTensor):
    """Every shard holds the whole value.

    ``ts`` is a list of equal shards, or one tensor placed ``shard_count`` times (the
    same tensor object in every shard: constructing relabels and does not copy).
    """

    __slots__ = ()

    def __init__(
        self,
        *,
        ts: Sequence[torch.Tensor] | torch.Tensor,
        shard_count: int | None = None,
        devices: Sequence[int] | None = None,
        pinned: bool = False,
        name: str | None = None,
    ):
        if _whole(ts):
            if shard_count is None:
                shard_count = len(devices) if devices is not None else None
            if shard_count is None:
                raise ValueError("ReplicatedTensor from one tensor needs shard_count or devices")
            ts = (ts,) * shard_count
        shards = _as_shard_tuple(ts, "ReplicatedTensor")
        if shard_count is not None and shard_count != len(shards):
            raise ValueError(f"shard_count={shard_count} but {len(shards)} shards were given")
        _check_same_shapes(shards, "ReplicatedTensor")
        super().__init__(shards, devices, pinned, shards[0].shape, name)

    @property
    def placement(self) -> Placement:
        return Replicate()


class UnreducedTensor(ShardedTensor):
    """Partial sums: the value is the sum of the shards (all of one shape)."""

    __slots__ = ()

    def __init__(
        self,
        *,
        ts: Sequence[torch.Tensor],
        devices: Sequence[int] | None = None,
        pinned: bool = False,
        name: str | None = None,
    ):
        shards = _as_shard_tuple(ts, "UnreducedTensor")
        _check_same_shapes(shards, "UnreducedTensor")
        super().__init__(shards, devices, pinned, shards[0].shape, name)

    @property
    def placement(self) -> Placement:
        return Partial()


def _check_same_shapes(shards, kind: str) -> None:
    ref = shards[0].shape
    for i, s in enumerate(shards):
        if s.shape != ref:
            raise ValueError(f"{kind} shards must have one shape: shard 0 is {list(ref)}, shard {i} is {list(s.shape)}")


def _norm_dim(dim: int, rank: int, what: str) -> int:
    if not -rank <= dim < max(rank, 1):
        raise ValueError(f"{what}={dim} is out of range for a tensor of rank {rank}")
    return dim % rank if rank else 0
