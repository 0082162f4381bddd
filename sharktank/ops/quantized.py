"""Plain (unsharded) :class:`~sharktank.types.QuantizedTensor` weights in the matrix and
lookup ops: the registrations that send ``(tensor, quantized)`` to the plain-tensor rules,
which dequantize inside the product (``matrix._dense``) or expand only the looked-up rows
(``nn._lookup``), and ``index_select`` of whole block rows (stacked experts). Sharded quantized weights (quantized shards of split or replicated
tensors) go through the sharded rules unchanged; the result equals dequantize-then-op.
"""

from __future__ import annotations

import torch

from ..types import QuantizedTensor
from .index import index_select, select_rows
from .matrix import _linear_torch, _matmul_torch, linear, matmul
from .nn import _embedding_torch, embedding_lookup

__all__: list[str] = []


linear.register(torch.Tensor, QuantizedTensor)(_linear_torch)
matmul.register(torch.Tensor, QuantizedTensor)(_matmul_torch)
embedding_lookup.register(torch.Tensor, QuantizedTensor)(_embedding_torch)
index_select.register(QuantizedTensor, int, torch.Tensor)(select_rows)
