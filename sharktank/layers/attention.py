"""Grouped-query attention with a contiguous KV cache.

Shapes: ``x`` is ``[B, S, hidden]``; the cache of one block is a pair of ``[B, T, kv_heads,
head_dim]`` tensors (split on the kv-head dim under tensor parallelism). New keys and values
are written at ``positions`` (``[B, S]``) with a functional ``index_put``; queries attend to
cache entries at or before their own position, among the first ``window`` entries when a
``window`` is given (a prompt from position 0 attends over its own ``S`` entries, not the whole
cache: at a 4096-entry cache that is most of a short prompt's attention work).

Paged (``pages`` given): the cache of one block is instead a pool of pages, a pair of ``[P,
page_size, kv_heads, head_dim]`` tensors shared by every sequence, and ``pages`` (``[B, Wp]``
int64) is each row's page table: its position ``p`` lives in page ``pages[b, p // page_size]``
at slot ``p % page_size``. Writes scatter into the flattened pool; a row attends over its
``Wp`` pages in order (``Wp * page_size`` entries, masked causally as above) with
:func:`sharktank.ops.paged_attention`, so the contiguous cache is the page table ``pages[b] =
b * T / page_size + arange(T / page_size)``. Eagerly (and traced for other targets) that op
gathers the pages before attending; traced for the CPU target, a decode step and a prompt
chunk read the pool through the table instead, only the chunks of entries each token's mask
keeps (:func:`sharktank.export.kernels.paged_attention`).
"""

from __future__ import annotations

import torch

from .. import ops
from ..types import UnreducedTensor
from .rotary import apply_rotary

__all__ = ["attention", "causal_mask"]


def _causal_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    return torch.arange(length)[None, None, None, :] <= positions[:, None, :, None]


def causal_mask(positions, length: int):
    """``[B, 1, S, length]`` booleans: True where a query at ``positions`` (``[B, S]``, plain
    or sharded) may attend to a cache entry (entries at or before its own position)."""
    return ops.elementwise(_causal_mask, positions, length=length)


def _keep_padding(padding: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.where(padding, old, new)


def _flat_entries(positions: torch.Tensor, *, length: int) -> torch.Tensor:
    """``[B * S]``: the index of each token's cache entry in the cache viewed as ``[B * T, ...]``."""
    return (torch.arange(positions.shape[0])[:, None] * length + positions).reshape(-1)


def _entries_at(cache, positions, b: int, s: int):
    """``cache[rows, positions]`` (``[B, S, kv, hd]``) as one ``index_select`` of the flattened
    cache (IREE 3.10 does not lower indexing by two tensors)."""
    t = cache.shape[1]
    flat = ops.flatten(cache, 0, 1)
    return ops.unflatten(ops.index_select(flat, 0, ops.elementwise(_flat_entries, positions, length=t)), 0, [b, s])


def _row_entries(rows: torch.Tensor, *, length: int, window) -> torch.Tensor:
    """``[B * window]``: the flat index (cache viewed as ``[B_cache * length, ...]``) of entries
    ``0..window-1`` of each cache row in ``rows`` (``[B]``)."""
    return (rows[:, None] * length + torch.arange(window)[None, :]).reshape(-1)


def _page_slots(pages: torch.Tensor, positions: torch.Tensor, *, size: int) -> torch.Tensor:
    """``[B * S]``: the flat pool index (pool viewed as ``[P * size, ...]``) of each token's entry."""
    page = torch.gather(pages, 1, torch.div(positions, size, rounding_mode="floor"))
    return (page * size + positions % size).reshape(-1)


def _paged_write(pool, pages, positions, new):
    """The pool with ``new`` (``[B, S, kv, hd]``) written at ``positions`` through the page
    table ``pages``: one ``index_put`` of the flattened pool."""
    size = pool.shape[1]
    flat = ops.flatten(pool, 0, 1)
    flat = ops.index_put(flat, [ops.elementwise(_page_slots, pages, positions, size=size)], ops.flatten(new, 0, 1))
    return ops.unflatten(flat, 0, [pool.shape[0], size])


def _rows_like(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return rows[:, None].expand(positions.shape)


def _window_of_rows(cache, rows, window):
    """Entries ``0..window-1`` (all when None) of cache rows ``rows``: ``[B, window, kv, hd]``,
    one ``index_select`` of the flattened cache."""
    b, t = rows.shape[0], cache.shape[1]
    w = t if window is None else window
    flat = ops.flatten(cache, 0, 1)
    picked = ops.index_select(flat, 0, ops.elementwise(_row_entries, rows, length=t, window=w))
    return ops.unflatten(picked, 0, [b, w])


def _first_entries(cache, window):
    """The cache's first ``window`` entries (dim 1). An int narrows (a view); a symbolic size
    (tracing) gathers them instead: a view of symbolic length makes torch.export guard on its
    contiguity (the view is contiguous only when ``window`` is the whole cache and the batch is
    1), which would refuse a prompt as long as the cache."""
    if isinstance(window, int):
        return ops.narrow(cache, 1, 0, window)
    return ops.index_select(cache, 1, torch.arange(window))


def attention(
    x, w, cache, positions: torch.Tensor, cos, sin, *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, mask=None, padding=None,
    window=None, rows=None, pages=None,
):
    """One attention block. ``w`` maps q/k/v/o names to weights (``q``, ``k``, ``v``, ``o`` and
    optional ``q_bias``...), and optionally ``q_norm`` and ``k_norm``: Qwen3's ``[head_dim]``
    RMSNorm weights (epsilon ``eps``), applied to each q and k head before rotary. ``mask``:
    :func:`causal_mask` of ``positions`` over the attended length, when the caller already has
    it (blocks that share positions share it); computed here otherwise. ``window``: attend over
    cache entries ``[0, window)`` only (an int, or a symbolic size while tracing; every position
    must be below it); None: the whole cache. ``rows`` (``[B]`` int64, plain or replicated): the
    cache row each input row reads and writes (a chunk of one prompt into row ``r`` of a
    batch cache); None: input row ``i`` is cache row ``i``. ``pages`` (``[B, Wp]`` int64, plain
    or replicated): ``cache`` is a page pool and these are the rows' page tables (module
    docstring); every position must be below ``Wp * page_size``. ``padding`` (``[B, S]`` booleans, plain or replicated): tokens whose keys
    and values are not kept: the cache entries they would write keep their contents (the
    old entries are read into the written values, so the write depends on the read).
    Returns ``(output, (k_cache, v_cache))``."""
    b, s = positions.shape
    x = ops.reshape(x, [b * s, x.shape[-1]])  # one 2-D input for the three products
    # unflatten, not reshape: the heads dim carries the split even when a shard holds one head.
    def heads(y, n):
        return ops.unflatten(ops.unflatten(y, 0, [b, s]), 2, [n, head_dim])

    q = heads(ops.linear(x, w["q"], w.get("q_bias")), num_heads)
    k = heads(ops.linear(x, w["k"], w.get("k_bias")), num_kv_heads)
    v = heads(ops.linear(x, w["v"], w.get("v_bias")), num_kv_heads)
    if "q_norm" in w:  # per head: the normalized dim (head_dim) is never the split one (heads)
        q, k = ops.rms_norm(q, w["q_norm"], epsilon=eps), ops.rms_norm(k, w["k_norm"], epsilon=eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    if sum(a is not None for a in (rows, padding, pages)) > 1:
        raise ValueError("attention takes one of rows, padding and pages")
    gqa = num_heads != num_kv_heads
    if pages is not None:
        k_pool, v_pool = (_paged_write(c, pages, positions, z) for c, z in zip(cache, (k, v)))
        mask = causal_mask(positions, pages.shape[1] * k_pool.shape[1]) if mask is None else mask

        def paged(q_):
            return ops.paged_attention(q_, k_pool, v_pool, pages, mask, enable_gqa=gqa)

        return _attend(q, paged, w, b, s, num_heads, head_dim), (k_pool, v_pool)
    at_rows = torch.arange(b)[:, None].expand(b, s) if rows is None else ops.elementwise(_rows_like, rows, positions)
    if padding is not None:
        pad = ops.reshape(padding, [b, s, 1, 1])  # broadcasts over the (maybe split) heads
        k, v = (ops.elementwise(_keep_padding, pad, _entries_at(c, positions, b, s), z) for c, z in zip(cache, (k, v)))
    k_cache = ops.index_put(cache[0], [at_rows, positions], k)
    v_cache = ops.index_put(cache[1], [at_rows, positions], v)

    if rows is not None:
        keys, values = (_window_of_rows(c, rows, window) for c in (k_cache, v_cache))
    else:
        keys, values = (k_cache, v_cache) if window is None else (_first_entries(c, window) for c in (k_cache, v_cache))
    mask = causal_mask(positions, keys.shape[1]) if mask is None else mask  # [B, 1, S, T or window]

    def contiguous(q_):
        return ops.scaled_dot_product_attention(q_, ops.transpose(keys, 1, 2), ops.transpose(values, 1, 2), mask, enable_gqa=gqa)

    return _attend(q, contiguous, w, b, s, num_heads, head_dim), (k_cache, v_cache)


def _attend(q, attend, w, b: int, s: int, num_heads: int, head_dim: int):
    """The attention output ``[B, S, hidden]`` of queries ``q`` (``[B, S, heads, hd]``), where
    ``attend`` maps them as ``[B, heads, S, hd]`` to their attention (over the cache or the
    pool), through the output projection (all-reduced when unreduced)."""
    dtype = q.dtype
    # Scores and softmax in float32 for half-precision models, as the references accumulate
    # (the ops compute k and v in q's dtype).
    up = (lambda z: ops.to(z, torch.float32)) if dtype != torch.float32 else (lambda z: z)
    out = attend(up(ops.transpose(q, 1, 2)))
    out = ops.reshape(ops.transpose(ops.to(out, dtype), 1, 2), [b * s, num_heads * head_dim])
    y = ops.linear(out, w["o"], w.get("o_bias"))
    y = ops.all_reduce(y) if isinstance(y, UnreducedTensor) else y
    return ops.reshape(y, [b, s, y.shape[-1]])
