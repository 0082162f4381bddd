"""The mixture-of-experts SwiGLU block, written once with sharktank.ops.

A router (a linear map hidden -> ``E`` logits) picks ``k`` experts per token by the family's
rule (:data:`ROUTINGS`); each chosen expert is a SwiGLU FFN, and the block returns their
outputs weighted by the routing weights. Experts are stacked on a leading expert dim: gate
and up ``[E, ffn, hidden]``, down ``[E, hidden, ffn]``.

The experts' products are :func:`sharktank.ops.expert_ffn`, by the number of (token,
expert) pairs: a decode step reads only the chosen experts' weights, in place (fewer pairs
than experts) or each expert once (batched decode); a prompt puts its tokens in expert order
and runs each expert over only the tokens that chose it, so it computes ``rows * k`` expert
rows, not ``rows * E``.

Tensor parallel: each expert's FFN is split as the dense one is (gate and up on ffn, down on
its ffn input) and the router is replicated, so routing is computed on every device alike,
each device computes its ffn slice of the chosen experts, and the weighted sum of partial
sums is all-reduced once: the same one collective as a dense FFN.

Expert parallel (the stacked experts split on the expert dim, whole experts per device):
routing is replicated, so every device knows every token's experts; each device runs its
own experts over the tokens that chose them (grouped), and one all-reduce of the ``[rows,
hidden]`` partial sums combines them. No tokens are dispatched: every device already holds
every token (attention is tensor-parallel over the same devices, its output all-reduced; or,
expert parallelism alone, replicated: each device computes it whole), so the combine is the
one collective, the same bytes as a dense FFN's all-reduce.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import ops
from ..types import UnreducedTensor

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


def moe_ffn(x, router, gate, up, down, *, top_k: int, routing: str, normalize: bool = True):
    """The mixture-of-experts FFN of ``x`` ``[..., hidden]``: ``router`` ``[E, hidden]``, experts
    ``gate``/``up`` ``[E, ffn, hidden]`` and ``down`` ``[E, hidden, ffn]`` (see the module
    docstring for the placements), ``top_k`` experts per token by the rule ``routing``.
    The experts' products are :func:`sharktank.ops.expert_ffn`: a decode step reads only the
    chosen experts, a prompt groups its tokens by expert."""
    *lead, hidden = x.shape
    e = router.shape[0]
    for name, w, want in (("gate", gate, (e, None, hidden)), ("up", up, (e, None, hidden)), ("down", down, (e, hidden, None))):
        if w.ndim != 3 or any(d is not None and d != s for d, s in zip(want, w.shape)):
            raise ValueError(f"moe_ffn: {name} experts {list(w.shape)} do not fit router [{e}, {hidden}] (expected {list(want)}, None: ffn)")
    x = ops.reshape(x, [-1, hidden])
    weights, experts = route(ops.linear(x, router), top_k, routing, normalize)
    y = ops.expert_ffn(x, weights, experts, gate, up, down)
    y = ops.all_reduce(y) if isinstance(y, UnreducedTensor) else y
    return ops.reshape(y, [*lead, hidden])
