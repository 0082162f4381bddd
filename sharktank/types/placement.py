"""Placements: small immutable data saying how a global tensor maps onto its shards.

A sharded tensor is global shape + placement + devices + shards. The placement says
how each shard relates to the global value:

- ``Split(dim)``  (printed ``S(dim)``): shards are consecutive pieces along ``dim``.
- ``Replicate()`` (printed ``R``): every shard holds the whole value.
- ``Partial()``   (printed ``P(sum)``): the value is the sum of the shards.

A :class:`ShardingSpec` adds where the shards live (``devices``) and whether they are
pinned there; it is what :func:`sharktank.ops.reshard` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "Placement",
    "Split",
    "Replicate",
    "Partial",
    "ShardingSpec",
    "split_sizes",
    "normalize_devices",
]


class Placement:
    """Base of the three placements. Instances are frozen and hashable."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Split(Placement):
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    def __str__(self) -> str:
        return "P(sum)"


def normalize_devices(devices: Sequence[int] | None, count: int) -> tuple[int, ...]:
    """Devices as a tuple of distinct non-negative ints, one per shard (default ``0..count-1``)."""
    if devices is None:
        return tuple(range(count))
    devices = tuple(devices)
    if len(devices) != count:
        raise ValueError(f"expected {count} devices (one per shard), found {len(devices)}: {devices}")
    for d in devices:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"devices must be non-negative ints, found {devices}")
    if len(set(devices)) != count:
        raise ValueError(f"devices must be distinct (one device per shard), found {devices}")
    return devices


def split_sizes(size: int, count: int) -> list[int]:
    """Shard sizes for splitting ``size`` elements into ``count`` pieces.

    Uses ``torch.tensor_split`` sizes: the first ``size % count`` shards get one extra
    element, so every count gives exactly ``count`` shards (some may be empty when
    ``size < count``).
    """
    if count < 1:
        raise ValueError(f"shard count must be >= 1, found {count}")
    base, extra = divmod(size, count)
    return [base + 1 if i < extra else base for i in range(count)]


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """Where and how a value is sharded: a placement, one device per shard, pinned or not."""

    placement: Placement
    devices: tuple[int, ...]
    pinned: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", normalize_devices(self.devices, len(tuple(self.devices))))

    @property
    def shard_count(self) -> int:
        return len(self.devices)

    @staticmethod
    def split(dim: int, count: int | None = None, devices: Sequence[int] | None = None, pinned: bool = False) -> "ShardingSpec":
        return ShardingSpec(Split(dim), _devices_for(count, devices), pinned)

    @staticmethod
    def replicate(count: int | None = None, devices: Sequence[int] | None = None, pinned: bool = False) -> "ShardingSpec":
        return ShardingSpec(Replicate(), _devices_for(count, devices), pinned)

    def __str__(self) -> str:
        pin = ", pinned" if self.pinned else ""
        return f"{self.placement} on {list(self.devices)}{pin}"


def _devices_for(count: int | None, devices: Sequence[int] | None) -> tuple[int, ...]:
    if devices is None:
        if count is None:
            raise ValueError("give a shard count or a device list")
        return tuple(range(count))
    devices = tuple(devices)
    if count is not None and count != len(devices):
        raise ValueError(f"shard count {count} does not match {len(devices)} devices {devices}")
    return devices
