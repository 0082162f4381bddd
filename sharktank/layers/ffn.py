"""The SwiGLU feed-forward block."""

from __future__ import annotations

import torch.nn.functional as F

from .. import ops
from ..types import UnreducedTensor

__all__ = ["swiglu_ffn"]


def _silu_mul(g, u):
    return F.silu(g) * u


def swiglu_ffn(x, gate, up, down):
    """``down(silu(gate(x)) * up(x))``. Column-parallel gate/up and row-parallel down give
    partial sums, which are all-reduced here."""
    h = ops.elementwise(_silu_mul, ops.linear(x, gate), ops.linear(x, up))
    y = ops.linear(h, down)
    return ops.all_reduce(y) if isinstance(y, UnreducedTensor) else y
