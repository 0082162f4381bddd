"""Deep equality of (possibly sharded) tensors."""

from __future__ import annotations

import torch

from .quantized import QuantizedTensor
from .sharded import ShardedTensor

__all__ = ["is_deep_equal"]


def is_deep_equal(a, b, *, compare_placement: bool = True) -> bool:
    """True when ``a`` and ``b`` have the same type, shapes and shard values.

    With ``compare_placement`` (the default) the devices and pinned flags must match
    too, as must placement-specific fields such as ``shard_dim``. Names are ignored.
    Lists, tuples and dicts are compared element by element. Use ``ops.equal`` to compare
    the values alone, whatever the sharding.
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, ShardedTensor):
        if a.shape != b.shape or a.shard_count != b.shard_count or a.placement != b.placement:
            return False
        if compare_placement and (a.devices != b.devices or a.pinned != b.pinned):
            return False
        return all(_tensor_equal(x, y) for x, y in zip(a.shards, b.shards))
    if isinstance(a, QuantizedTensor):
        return a.equal(b)
    if isinstance(a, torch.Tensor):
        return _tensor_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(is_deep_equal(x, y, compare_placement=compare_placement) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(is_deep_equal(a[k], b[k], compare_placement=compare_placement) for k in a)
    return a == b


def _tensor_equal(x, y) -> bool:
    if isinstance(x, QuantizedTensor):
        return x.equal(y)
    return x.dtype == y.dtype and x.shape == y.shape and bool(torch.equal(x, y))
