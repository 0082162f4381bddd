"""Sharded ops: one dispatcher, one placement rule, one rule table per op family.

Every op here takes plain ``torch.Tensor``s and sharded tensors
(:mod:`sharktank.types`). Before an implementation runs, the dispatcher applies the
placement rule (:func:`transfer_if_needed`). Importing this module does not import
iree-turbine or the IREE compiler; they are imported only while tracing for export.
"""

from ._build import ShardingError
from ._dispatch import NoImplementationError, registered_ops, sharded_op
from ._placement import PlacementError, transfer_if_needed
from ._transfer import Transfer, TransferLog, record_transfers
from .collectives import (
    all_gather,
    all_reduce,
    barrier_on_logical_device,
    equal,
    reduce_scatter,
    replicate,
    reshard,
    reshard_like,
    reshard_split,
    sharded_cat,
    sharded_sum,
    transfer_to_logical_device,
    unshard,
)
from .coalesce import BUCKET_BYTES, FIRST_BUCKET_BYTES, all_reduce_coalesced, bucket_sizes, transfer_coalesced
from .elementwise import add, div, elementwise, mul, sub, to
from .matrix import block_kernels, linear, matmul
from .experts import expert_ffn
from .index import index_put, index_select, take_along_dim
from .nn import attention_as_matmuls, attention_kernels, embedding_lookup, layer_norm, paged_attention, rms_norm, scaled_dot_product_attention, softmax
from .reduction import argmax, mean, sum
from . import quantized as _quantized  # noqa: E402,F401  (registers quantized-weight rules)
from .shape import cat, expand, flatten, narrow, permute, reshape, transpose, unflatten, view

__all__ = [
    # dispatcher and placement
    "sharded_op",
    "registered_ops",
    "transfer_if_needed",
    "record_transfers",
    "Transfer",
    "TransferLog",
    "PlacementError",
    "ShardingError",
    "NoImplementationError",
    # collectives and placement ops
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
    # coalesced transfers
    "all_reduce_coalesced",
    "transfer_coalesced",
    "bucket_sizes",
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    # compute
    "elementwise",
    "add",
    "sub",
    "mul",
    "div",
    "to",
    "matmul",
    "linear",
    "expert_ffn",
    "block_kernels",
    "softmax",
    "rms_norm",
    "layer_norm",
    "scaled_dot_product_attention",
    "paged_attention",
    "attention_as_matmuls",
    "attention_kernels",
    "embedding_lookup",
    "index_select",
    "take_along_dim",
    "index_put",
    "sum",
    "mean",
    "argmax",
    # shapes
    "cat",
    "reshape",
    "view",
    "flatten",
    "unflatten",
    "transpose",
    "permute",
    "expand",
    "narrow",
]
