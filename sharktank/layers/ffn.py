"""The SwiGLU feed-forward block."""

from __future__ import annotations

import torch.nn.functional as F

from .. import ops
from ..types import UnreducedTensor

__all__ = ["swiglu_ffn"]


def _silu_mul(g, u):
    return F.silu(g) * u


def swiglu_ffn(x, gate, up, down, gate_bias=None, up_bias=None, down_bias=None):
    """``down(silu(gate(x)) * up(x))`` (with optional biases). Column-parallel gate/up and
    row-parallel down give partial sums, which are all-reduced here (a replicated down bias
    is added to one partial sum)."""
    *lead, hidden = x.shape
    x = ops.reshape(x, [-1, hidden])  # one 2-D input for all three products
    h = ops.elementwise(_silu_mul, ops.linear(x, gate, gate_bias), ops.linear(x, up, up_bias))
    y = ops.linear(h, down, down_bias)
    y = ops.all_reduce(y) if isinstance(y, UnreducedTensor) else y
    return ops.reshape(y, [*lead, y.shape[-1]])
