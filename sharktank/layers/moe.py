"""The mixture-of-experts SwiGLU block, written once with sharktank.ops.

A router (a linear map hidden -> ``E`` logits) picks ``k`` experts per token by the family's
rule (:data:`ROUTINGS`); each chosen expert is a SwiGLU FFN, and the block returns their
outputs weighted by the routing weights. Experts are stacked on a leading expert dim: gate
and up ``[E, ffn, hidden]``, down ``[E, hidden, ffn]``.

Two evaluations give the same values (:func:`moe_ffn` picks by the number of rows):

- *gathered*, for few tokens (decode): the chosen experts' weights are gathered along the
  expert dim, so a step reads ``rows * k`` experts' weights, not all ``E``;
- *grouped* (:func:`sharktank.ops.expert_ffn`), once ``rows * k >= E`` (prefill) or when the
  expert dim is split: the tokens are put in expert order and each expert runs over only the
  tokens that chose it, so a prompt computes ``rows * k`` expert rows, not ``rows * E``.

Tensor parallel: each expert's FFN is split as the dense one is (gate and up on ffn, down on
its ffn input) and the router is replicated, so routing is computed on every device alike,
each device computes its ffn slice of the chosen experts, and the weighted sum of partial
sums is all-reduced once: the same one collective as a dense FFN.

Expert parallel (the stacked experts split on the expert dim, whole experts per device):
routing is replicated, so every device knows every token's experts; each device runs its
own experts over the tokens that chose them (grouped), and one all-reduce of the ``[rows,
hidden]`` partial sums combines them. No tokens are dispatched: every device already holds
every token (attention is tensor-parallel over the same devices, its output all-reduced), so
the combine is the one collective, the same bytes as a dense FFN's all-reduce.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..types import SplitPrimitiveTensor, UnreducedTensor

__all__ = ["ROUTINGS", "route", "moe_ffn"]


def _topk_softmax(logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Mixtral: softmax over the chosen experts' logits (always sums to 1)."""
    return torch.softmax(logits.float().gather(-1, experts), dim=-1)


def _softmax_topk(logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Qwen3-MoE: softmax over all experts, the chosen ones' probabilities kept, renormalised
    to sum 1 when ``normalize`` (its ``norm_topk_prob``)."""
    w = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    return w / w.sum(dim=-1, keepdim=True) if normalize else w


# Routing rule name (a family's ``routing``) -> the float32 weights of the chosen experts.
ROUTINGS: dict[str, Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]] = {
    "topk_softmax": _topk_softmax,
    "softmax_topk": _softmax_topk,
}


def _chosen(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest logits' experts, largest first: the k largest probabilities under
    either rule (softmax is monotonic). Written as ``k`` argmax passes, not ``torch.topk``:
    IREE 3.10 compiled a Mixtral prefill's ``topk`` of dynamic rows to wrong experts (logits
    off by 1e-1), while this form compiles to the eager values."""
    cols = torch.arange(logits.shape[-1], device=logits.device)
    chosen = []
    for _ in range(k):
        best = logits.argmax(dim=-1, keepdim=True)
        chosen.append(best)
        logits = logits.masked_fill(cols == best, float("-inf"))
    return torch.cat(chosen, dim=-1)


def route(logits, top_k: int, routing: str, normalize: bool = True):
    """``(weights, experts)`` for router ``logits`` ``[rows, E]`` (plain or replicated): the
    ``top_k`` chosen experts of each row (int64 ``[rows, top_k]``, largest logit first) and
    their float32 weights by the rule ``routing`` (a key of :data:`ROUTINGS`)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} is not known; known: {', '.join(ROUTINGS)}")
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be in 1..{logits.shape[-1]} (the experts)")
    experts = ops.elementwise(_chosen, logits, k=top_k)
    weights = ops.elementwise(ROUTINGS[routing], logits, experts, normalize=normalize)
    return weights, experts


def _silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def _select(w, index):
    """The experts ``index`` of stacked weights ``w`` (plain, split or quantized)."""
    return ops.index_select(w, 0, index)


def _experts_gathered(x, weights, experts, gate, up, down):
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` with only the chosen experts read."""
    rows, hidden = x.shape
    k = experts.shape[-1]
    n = rows * k
    flat = ops.reshape(experts, [n])
    xs = ops.reshape(ops.expand(ops.reshape(x, [rows, 1, 1, hidden]), [rows, k, 1, hidden]), [n, 1, hidden])
    g = ops.matmul(xs, _select(gate, flat), transpose_rhs=True)  # [n, 1, ffn]
    u = ops.matmul(xs, _select(up, flat), transpose_rhs=True)
    y = ops.matmul(ops.elementwise(_silu_mul, g, u), _select(down, flat), transpose_rhs=True)  # [n, 1, hidden]
    y = ops.mul(y, ops.reshape(ops.to(weights, x.dtype), [n, 1, 1]))
    return ops.sum(ops.reshape(y, [rows, k, hidden]), dim=1)


def _split_experts(w) -> bool:
    return isinstance(w, SplitPrimitiveTensor) and w.shard_dim == 0 and w.shard_count > 1


def moe_ffn(x, router, gate, up, down, *, top_k: int, routing: str, normalize: bool = True, gathered: bool | None = None):
    """The mixture-of-experts FFN of ``x`` ``[..., hidden]``: ``router`` ``[E, hidden]``, experts
    ``gate``/``up`` ``[E, ffn, hidden]`` and ``down`` ``[E, hidden, ffn]`` (see the module
    docstring for the placements), ``top_k`` experts per token by the rule ``routing``.
    ``gathered``: read only the chosen experts by gathering their weights (default: when
    ``rows * top_k < E`` for a static number of rows, and the expert dim is not split);
    otherwise group the tokens by expert (:func:`sharktank.ops.expert_ffn`)."""
    *lead, hidden = x.shape
    e = router.shape[0]
    for name, w, want in (("gate", gate, (e, None, hidden)), ("up", up, (e, None, hidden)), ("down", down, (e, hidden, None))):
        if w.ndim != 3 or any(d is not None and d != s for d, s in zip(want, w.shape)):
            raise ValueError(f"moe_ffn: {name} experts {list(w.shape)} do not fit router [{e}, {hidden}] (expected {list(want)}, None: ffn)")
    x = ops.reshape(x, [-1, hidden])
    weights, experts = route(ops.linear(x, router), top_k, routing, normalize)
    if gathered is None:  # a traced prompt's symbolic length takes the all-experts form
        rows = x.shape[0]
        gathered = isinstance(rows, int) and rows * top_k < e and not _split_experts(gate)
    y = (_experts_gathered if gathered else ops.expert_ffn)(x, weights, experts, gate, up, down)
    y = ops.all_reduce(y) if isinstance(y, UnreducedTensor) else y
    return ops.reshape(y, [*lead, hidden])
