"""Grouped-query attention with a contiguous KV cache.

Shapes: ``x`` is ``[B, S, hidden]``; the cache of one block is a pair of ``[B, T, kv_heads,
head_dim]`` tensors (split on the kv-head dim under tensor parallelism). New keys and values
are written at ``positions`` (``[B, S]``) with a functional ``index_put``; queries attend to
cache entries at or before their own position.
"""

from __future__ import annotations

import torch

from .. import ops
from ..types import UnreducedTensor
from .rotary import apply_rotary

__all__ = ["attention"]


def _causal_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    return torch.arange(length)[None, None, None, :] <= positions[:, None, :, None]


def attention(x, w, cache, positions: torch.Tensor, cos, sin, *, num_heads: int, num_kv_heads: int, head_dim: int):
    """One attention block. ``w`` maps q/k/v/o names to weights (``q``, ``k``, ``v``, ``o`` and
    optional ``q_bias``...). Returns ``(output, (k_cache, v_cache))``."""
    b, s = positions.shape
    q = ops.reshape(ops.linear(x, w["q"], w.get("q_bias")), [b, s, num_heads, head_dim])
    k = ops.reshape(ops.linear(x, w["k"], w.get("k_bias")), [b, s, num_kv_heads, head_dim])
    v = ops.reshape(ops.linear(x, w["v"], w.get("v_bias")), [b, s, num_kv_heads, head_dim])
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    rows = torch.arange(b)[:, None].expand(b, s)
    k_cache = ops.index_put(cache[0], [rows, positions], k)
    v_cache = ops.index_put(cache[1], [rows, positions], v)

    t = k_cache.shape[1]
    mask = ops.elementwise(_causal_mask, positions, length=t)  # [B, 1, S, T]
    dtype = q.dtype
    # Scores and softmax in float32 for half-precision models, as the references accumulate
    # (the op computes k and v in q's dtype).
    up = (lambda z: ops.to(z, torch.float32)) if dtype != torch.float32 else (lambda z: z)
    out = ops.scaled_dot_product_attention(
        up(ops.transpose(q, 1, 2)),
        ops.transpose(k_cache, 1, 2),
        ops.transpose(v_cache, 1, 2),
        mask,
        enable_gqa=num_heads != num_kv_heads,
    )
    out = ops.reshape(ops.transpose(ops.to(out, dtype), 1, 2), [b, s, num_heads * head_dim])
    y = ops.linear(out, w["o"], w.get("o_bias"))
    return (ops.all_reduce(y) if isinstance(y, UnreducedTensor) else y), (k_cache, v_cache)
