"""Sharded tensor types, placements and GGML-quantized tensors. This layer knows nothing of
``sharktank.ops``."""

from .equality import is_deep_equal
from .placement import Partial, Placement, Replicate, ShardingSpec, Split, split_sizes
from .pytree import register_pytree_nodes
from .quantized import LAYOUTS, BlockLayout, QuantizationError, QuantizedTensor, stored
from .sharded import ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor

register_pytree_nodes()

__all__ = [
    "ShardedTensor",
    "SplitPrimitiveTensor",
    "ReplicatedTensor",
    "UnreducedTensor",
    "is_deep_equal",
    "Placement",
    "Split",
    "Replicate",
    "Partial",
    "ShardingSpec",
    "split_sizes",
    "QuantizedTensor",
    "BlockLayout",
    "LAYOUTS",
    "QuantizationError",
    "stored",
]
