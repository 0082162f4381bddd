"""``expert_ffn``: a mixture of experts' SwiGLU experts, reading or computing only what the
routing chose.

By the number of (token, expert) pairs ``n = rows * k`` (:func:`local_experts`): a decode
step (static ``n``) reads each pair's expert in place (:func:`gathered`, ``n < E``: an expert
two pairs chose is read twice; on the CPU one kernel dispatch per weight for all pairs) or
every expert once (:func:`every`, ``n >= E``); a prompt (``n`` traced, dynamic) groups the
tokens by expert (:func:`grouped`):

The ``rows * k`` (token, expert) pairs are put in expert order (a counting sort written with
a one-hot cumulative sum and one scatter of the permutation: IREE 3.10 cannot compile a sort
of a dynamic length on the CPU), each expert's FFN runs over its contiguous run of pairs (a
length known only from the data), the outputs are weighted and put back in pair order (a
gather), and each token sums its ``k`` pairs. An expert no token chose runs over zero rows.
So a prompt computes ``rows * k`` expert rows, not ``rows * E``.

Traced for export, each run's start and length are data (``Tensor.item``): torch.export
makes them unbacked symbols, and the importer (:func:`sharktank.export.llama.import_programs`)
drops the range assertions torch adds for them, which iree-turbine cannot import.

Rule: ``x``, ``weights`` and ``experts`` plain or replicated over the stacked experts'
devices; the stacked experts (``gate``/``up`` ``[E, ffn, hidden]``, ``down`` ``[E, hidden,
ffn]``, plain or quantized) plain, replicated, or split over those devices either

- on the expert dim (expert parallelism: whole experts per device): each device runs its own
  experts' runs (pairs that chose another device's experts are not computed; in a decode
  step's in-place form, with fewer pairs than local experts, such a pair reads a local expert
  and is weighted zero, so a device reads ``n`` experts), or
- on each expert's ffn (gate and up on dim 1, down on dim 2): each device runs every run
  over its ffn slice.

Either split gives an :class:`~sharktank.types.UnreducedTensor` (each device's partial sum,
combined with one ``all_reduce`` by the caller); no data is moved between devices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..types import QuantizedTensor, ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor
from ._build import ShardingError, replicated_of, unreduced_of
from ._dispatch import sharded_op
from ._transfer import _tracing_tensor
from .matrix import _f_linear, expert_kernel_product

__all__ = ["expert_ffn"]

AnyTensor = torch.Tensor | ShardedTensor
Weight = torch.Tensor | QuantizedTensor | ShardedTensor


@sharded_op(nargs=1)
def expert_ffn(x: AnyTensor, weights: AnyTensor, experts: AnyTensor, gate: Weight, up: Weight, down: Weight) -> AnyTensor:
    """``out[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for ``x`` ``[rows,
    hidden]``, ``experts`` (int64) and ``weights`` ``[rows, k]``, with SwiGLU experts
    ``down[e] @ (silu(gate[e] @ x) * (up[e] @ x))``. Each expert runs over only the tokens
    that chose it (see the module docstring for the algorithm and the sharded forms)."""


def _expert(w, e: int):
    """Expert ``e`` of stacked weights (plain or quantized) as a 2-D weight (``e`` may be a
    traced symbol: a slice at a data offset)."""
    if isinstance(w, QuantizedTensor):
        return w.with_blocks(w.blocks.narrow(0, e, 1)[0], w.shape[1:])
    return w.narrow(0, e, 1)[0]


def _pair_ffn(x: torch.Tensor, gate, up, down, index: "torch.Tensor | int", local: int) -> torch.Tensor:
    """The SwiGLU FFN of the rows ``x`` by the expert ``index`` (an int, or an int64 0-d
    tensor in 0 .. local - 1) of the stacked weights: each product reads that expert's weight
    in place, in the CPU kernels' form for stacked experts where they take it (no copy of the
    weight, no dequantized copy of quantized blocks), else as a slice at the index (a tensor
    index read with ``Tensor.item``)."""
    at = index if isinstance(index, int) else None
    # A factory op, not torch.tensor: torch.export lifts a tensor made from data into a
    # constant copied with an in-place detach_, which iree-turbine leaves as a torch.operator.
    which = torch.full((1,), index, dtype=torch.int64, device=x.device) if isinstance(index, int) else index

    def product(h: torch.Tensor, w) -> torch.Tensor:
        nonlocal at
        y = expert_kernel_product(h, w, which)
        if y is None:
            if at is None:
                at = _run(index, local - 1)
            y = _f_linear(h, _expert(w, at))
        return y

    return product(F.silu(product(x, gate)) * product(x, up), down)


def _run(n: torch.Tensor, limit) -> int:
    """A run's start or length as an int (an unbacked symbol when traced), in 0..limit."""
    v = n.item()
    torch._check(v >= 0)
    torch._check(v <= limit)
    return v


def local_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate, up, down, first: int = 0) -> torch.Tensor:
    """The op on plain tensors for the experts ``first .. first + gate.shape[0]`` of the
    routing (pairs that chose others contribute zero), by the number of pairs ``n``:

    - a traced prompt (``n`` dynamic): :func:`grouped`, ``n`` expert rows computed;
    - a static ``n`` below the local experts (decode): :func:`gathered`, ``n`` experts read
      in place;
    - a static ``n`` of at least the local experts, traced (batched decode): :func:`every`,
      each local expert read once and run over every token, weighted; run eagerly, grouped.

    Decode is bound by reading weights and reads ``min(n, E)`` experts' weights; a prompt is
    bound by computing and computes ``n`` expert rows. (A static ``n`` also avoids the data
    sized runs, which IREE 3.10 fails to compile there: "value set has 1 dynamic dimensions".)"""
    n = experts.numel()
    if isinstance(n, int) and n < gate.shape[0]:
        return gathered(x, weights, experts, gate, up, down, first)
    if isinstance(n, int) and _tracing_tensor(x):
        return every(x, weights, experts, gate, up, down, first)
    return grouped(x, weights, experts, gate, up, down, first)


def _local(experts: torch.Tensor, weights: torch.Tensor, first: int, local: int):
    """Each pair's local expert index (clamped into range) and its weight (zero for a pair
    of another device's expert)."""
    e = experts - first
    mine = (e >= 0).to(weights.dtype) * (e < local).to(weights.dtype)
    return e.clamp(0, local - 1), weights * mine


def gathered(x, weights, experts, gate, up, down, first: int = 0) -> torch.Tensor:
    """One product per pair with its expert's weights read in place. Where the CPU kernels
    take the weights, each of gate, up and down is one call over every pair (:func:`_pairs`);
    else each pair's expert is sliced at its index (:func:`_pair_ffn`, ``Tensor.item``). A
    gather of the chosen experts' weights copied them first (7.6 against 5.0 ms for a
    Mixtral-shaped layer's two float32 experts here); so does IREE for a slice at a data
    offset that a dispatch takes as an operand (a copy dispatch of the slice, then the
    product), which the kernels' stacked form avoids."""
    rows, hidden = x.shape
    k = experts.shape[-1]
    local = gate.shape[0]
    e, w = _local(experts, weights, first, local)
    w = w.to(x.dtype)
    y = _pairs(x.repeat_interleave(k, 0), gate, up, down, e.reshape(-1))
    if y is not None:
        return (y * w.reshape(-1, 1)).reshape(rows, k, hidden).sum(1)
    out = []
    for t in range(rows):
        xt = x.narrow(0, t, 1)
        y = 0
        for j in range(k):
            y = y + _pair_ffn(xt, gate, up, down, e[t, j], local) * w[t, j]
        out.append(y)
    return torch.cat(out, 0)


def _pairs(xp: torch.Tensor, gate, up, down, index: torch.Tensor) -> torch.Tensor | None:
    """Row ``p`` of ``xp`` through expert ``index[p]``'s SwiGLU FFN for every pair in three
    kernel calls (each reading the pairs' experts in place, one dispatch each), or None where
    the kernels do not take these weights (or it is not traced)."""
    g = expert_kernel_product(xp, gate, index)
    u = None if g is None else expert_kernel_product(xp, up, index)
    if u is None:
        return None
    return expert_kernel_product(F.silu(g) * u, down, index)


def every(x, weights, experts, gate, up, down, first: int = 0) -> torch.Tensor:
    """Every local expert over every token, weighted (zero where a token chose another): each
    expert's weights read once for all the step's rows, in place (:func:`_pairs`: expert i
    the i-th pair of all the rows; else :func:`_pair_ffn` per expert)."""
    rows, hidden = x.shape
    local = gate.shape[0]
    e, w = _local(experts, weights, first, local)
    # A one-hot sum rather than a scatter: IREE 3.10 crashes lowering a scatter of dynamic rows.
    one_hot = e[..., None] == torch.arange(local, device=x.device)  # [rows, k, local]
    dense = (one_hot.to(w.dtype) * w[..., None]).sum(1).to(x.dtype)  # [rows, local]
    y = _pairs(x.repeat(local, 1), gate, up, down, torch.arange(local, device=x.device))
    if y is not None:
        return (y.reshape(local, rows, hidden) * dense.transpose(0, 1)[..., None]).sum(0)
    y = 0
    for i in range(local):
        y = y + _pair_ffn(x, gate, up, down, i, local) * dense[:, i : i + 1]
    return y


def grouped(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate, up, down, first: int = 0) -> torch.Tensor:
    """The pairs put in expert order, each local expert run over its own run of them."""
    rows, hidden = x.shape
    k = experts.shape[-1]
    local = gate.shape[0]
    flat = experts.reshape(-1) - first
    n = flat.shape[0]
    # Pairs of other devices' experts go to one extra group after the local ones.
    # (Two selects, not a boolean and: IREE 3.10 does not lower torch's tensor ``&``.)
    other = torch.full_like(flat, local)
    group = torch.where(flat < 0, other, torch.where(flat < local, flat, other))
    one_hot = (group[:, None] == torch.arange(local + 1, device=x.device)).to(torch.int64)  # [n, local+1]
    counts = one_hot.sum(0)
    starts = torch.cumsum(counts, 0) - counts
    rank = (torch.cumsum(one_hot, 0) * one_hot).sum(1) - 1  # each pair's place in its group
    place = starts.index_select(0, group) + rank  # each pair's place in expert order
    order = torch.zeros_like(place).index_put((place,), torch.arange(n, device=x.device))
    xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # pair rows, in expert order
    outs = []
    for e in range(local):
        start, count = _run(starts[e], n), _run(counts[e], n)
        torch._check(start + count <= n)
        outs.append(_pair_ffn(xs.narrow(0, start, count), gate, up, down, e, local))
    done = sum(o.shape[0] for o in outs)
    outs.append(x.new_zeros(n - done, hidden))  # the other devices' pairs
    y = torch.cat(outs, 0).index_select(0, place)  # back in pair order [n, hidden]
    y = y * weights.reshape(n, 1).to(x.dtype)
    return y.reshape(rows, k, hidden).sum(1)


expert_ffn.register(torch.Tensor)(local_experts)


def _split_form(gate, up, down) -> str:
    dims = tuple(w.shard_dim if isinstance(w, SplitPrimitiveTensor) else None for w in (gate, up, down))
    if dims == (None, None, None) and all(isinstance(w, ReplicatedTensor) for w in (gate, up, down)):
        return "replicated"
    if dims == (0, 0, 0):
        return "experts"
    if dims == (1, 1, 2):
        return "ffn"
    raise ShardingError(
        f"ops.expert_ffn: the stacked experts must be split alike on the expert dim (0, 0, 0), on each expert's "
        f"ffn (1, 1, 2) or replicated; found gate, up, down split on {dims}"
    )


def _shards(t, n: int, devices, what: str):
    if isinstance(t, torch.Tensor):
        return [t] * n
    if not isinstance(t, ReplicatedTensor):
        raise ShardingError(f"ops.expert_ffn: {what} must be plain or replicated, found {type(t).__name__} {list(t.shape)}")
    if t.devices != devices:
        raise ShardingError(f"ops.expert_ffn: {what} is on devices {t.devices}, the experts on {devices}")
    return t.shards


@expert_ffn.register(ShardedTensor)
def _expert_ffn_sharded(x, weights, experts, gate, up, down):
    form = _split_form(gate, up, down)
    devices = gate.devices
    n = gate.shard_count
    xs, ws, es = (_shards(t, n, devices, what) for t, what in ((x, "x"), (weights, "weights"), (experts, "experts")))
    firsts = [0] * n
    if form == "experts":
        for i in range(1, n):
            firsts[i] = firsts[i - 1] + gate.shard_sizes[i - 1]
    out = [local_experts(*a, f) for *a, f in zip(xs, ws, es, gate.shards, up.shards, down.shards, firsts)]
    return replicated_of(out, devices) if form == "replicated" else unreduced_of(out, devices)
