"""Torch pytree registration: torch.export sees one argument per shard.

The flatten context carries everything but the shard values (type-specific fields,
devices, pinned, name), so unflattening rebuilds the same placement.
"""

from __future__ import annotations

import torch.utils._pytree as pytree

from .quantized import QuantizedTensor
from .sharded import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor

__all__ = ["register_pytree_nodes"]


def _flatten(t):
    ctx = (t._init_kwargs(),)
    ctx[0].pop("ts")
    return list(t.shards), _freeze(ctx[0])


def _flatten_with_keys(t):
    leaves, ctx = _flatten(t)
    return [(pytree.SequenceKey(i), leaf) for i, leaf in enumerate(leaves)], ctx


def _freeze(kwargs: dict):
    # Context must be hashable/comparable for pytree spec equality.
    return tuple(sorted(kwargs.items()))


def _unflattener(cls):
    def unflatten(values, context):
        return cls(ts=list(values), **dict(context))

    return unflatten


_registered = False


def register_pytree_nodes() -> None:
    """Register the three sharded types and QuantizedTensor (idempotent)."""
    global _registered
    if _registered:
        return
    for cls in (SplitPrimitiveTensor, ReplicatedTensor, UnreducedTensor):
        pytree.register_pytree_node(
            cls,
            _flatten,
            _unflattener(cls),
            serialized_type_name=f"sharktank.types.{cls.__name__}",
            flatten_with_keys_fn=_flatten_with_keys,
        )
    # A quantized tensor: its blocks are the one leaf; layout, shape, dtype and name the context.
    pytree.register_pytree_node(
        QuantizedTensor,
        lambda q: ([q.blocks], (q.layout.name, tuple(q.shape), q.dtype, q.name)),
        lambda values, ctx: QuantizedTensor(ctx[0], ctx[1], values[0], dtype=ctx[2], name=ctx[3]),
        serialized_type_name="sharktank.types.QuantizedTensor",
        flatten_with_keys_fn=lambda q: ([(pytree.SequenceKey(0), q.blocks)], (q.layout.name, tuple(q.shape), q.dtype, q.name)),
    )
    _registered = True
