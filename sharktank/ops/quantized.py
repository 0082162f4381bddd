"""Quantized weights (:class:`~sharktank.types.QuantizedTensor`) in the matrix and lookup ops.

A plain (unsharded) quantized weight: ``linear`` and ``matmul`` dequantize it to the
activations' dtype and multiply, so the result equals dequantize-then-op; ``embedding_lookup``
expands only the blocks of the rows it looks up. Sharded quantized weights are not supported
yet (issue 14).
"""

from __future__ import annotations

import torch

from ..types import QuantizedTensor
from .matrix import _linear_torch, _matmul_torch, linear, matmul
from .nn import embedding_lookup

__all__: list[str] = []


@linear.register(torch.Tensor, QuantizedTensor)
def _linear_quantized(x, weight, bias=None):
    return _linear_torch(x, weight.dequantize(x.dtype), bias)


@matmul.register(torch.Tensor, QuantizedTensor)
def _matmul_quantized(lhs, rhs, *, transpose_rhs=False):
    return _matmul_torch(lhs, rhs.dequantize(lhs.dtype), transpose_rhs=transpose_rhs)


@embedding_lookup.register(torch.Tensor, QuantizedTensor)
def _embedding_quantized(input, embedding_matrix, dtype=None):
    t = embedding_matrix
    if t.ndim != 2:
        raise ValueError(f"ops.embedding_lookup expects a [vocab, dim] table, found {t!r}")
    rows = QuantizedTensor(t.layout, (*input.shape, t.shape[1]), t.blocks[input], dtype=t.dtype, name=t.name)
    return rows.dequantize(dtype)
