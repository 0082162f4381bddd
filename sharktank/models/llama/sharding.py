"""Tensor-parallel sharding of Llama weights, placed on each stage's device groups.

Column-parallel (split on the output dim, 0): q/k/v projections, gate and up (and their biases).
Row-parallel (split on the input dim, 1): o and down; their outputs are partial sums that
the layers all-reduce. Mixture-of-experts blocks: the router is replicated and every expert
is split as the dense FFN (stacked gate/up on their ffn dim 1, down on its ffn dim 2), so one
all-reduce combines the experts' partial sums (``layers.moe``); or, expert-parallel, the
expert dim is split over the same group (:data:`EXPERT_SPLITS`), again with one all-reduce.
Replicated: norms and the token embedding, and Qwen3's q/k norms (one
``[head_dim]`` weight shared by every head: each device applies it to the heads it holds).
The LM head is split on the vocabulary (column-parallel) and gathered at the end. KV heads
are split across the tensor-parallel group, so ``tp`` must divide ``num_kv_heads``
(replicating KV heads is not supported). Every weight is pinned to its device group; activations are not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...parallel import ParallelPlan, PlanError
from ...types import ReplicatedTensor, SplitPrimitiveTensor
from ...weights import Theta
from .config import LlamaConfig

__all__ = ["EXPERT_SPLITS", "StageWeights", "shard_weights", "check_tp", "check_experts"]

_SPLIT_DIM = {
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.bias": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
    "mlp.gate_proj.bias": 0,
    "mlp.up_proj.bias": 0,
    # Row-parallel biases (o_proj, down_proj) are replicated: added once to the partial sums.
}


# How the stacked experts [E, ...] are split over a stage's device group, by name: "ffn" splits
# each expert as the dense FFN is (every device holds a slice of every expert); "experts"
# splits the expert dim (expert parallelism: whole experts per device, E / group size each).
# The router is replicated either way.
EXPERT_SPLITS: dict[str, dict[str, int]] = {
    "ffn": {"mlp.experts.gate_proj.weight": 1, "mlp.experts.up_proj.weight": 1, "mlp.experts.down_proj.weight": 2},
    "experts": {"mlp.experts.gate_proj.weight": 0, "mlp.experts.up_proj.weight": 0, "mlp.experts.down_proj.weight": 0},
}


@dataclass(frozen=True)
class StageWeights:
    """The weights one replica of one stage holds, pinned to its device group."""

    devices: tuple[int, ...]
    blocks: dict[int, dict[str, object]]  # block index -> {"q": ..., "k": ..., "gate": ...}
    embed: object | None = None  # first stage only
    norm: object | None = None  # last stage only
    lm_head: object | None = None  # last stage only


def check_tp(config: LlamaConfig, tp: int) -> None:
    """Refuse a tensor-parallel size that does not divide the heads."""
    if config.num_kv_heads % tp or config.num_heads % tp:
        raise PlanError(
            f"tp={tp} must divide num_heads={config.num_heads} and num_kv_heads={config.num_kv_heads}: "
            f"KV heads are split across the tensor-parallel group, not replicated"
        )


def check_experts(config: LlamaConfig, experts: str, tp: int) -> None:
    """Refuse an unknown expert split, or an expert-parallel one whose group size does not divide E."""
    if experts not in EXPERT_SPLITS:
        raise PlanError(f"expert split {experts!r} is not known; known: {', '.join(EXPERT_SPLITS)}")
    if experts == "experts" and not config.is_moe:
        raise PlanError("expert parallelism needs a mixture-of-experts model; this one has a dense FFN per block")
    if experts == "experts" and config.num_experts % tp:
        raise PlanError(f"ep={tp}: num_experts={config.num_experts} is not divisible by {tp} (whole experts per device)")


def _place(t: torch.Tensor, split_dim: int | None, devices: tuple[int, ...], name: str):
    if split_dim is None:
        return ReplicatedTensor(ts=t, devices=devices, pinned=True, name=name)
    return SplitPrimitiveTensor(shard_dim=split_dim, ts=t, devices=devices, pinned=True, name=name)


_SHORT = {
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "mlp.gate_proj.bias": "gate_bias",
    "mlp.up_proj.bias": "up_bias",
    "mlp.down_proj.bias": "down_bias",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "mlp.gate.weight": "router",
    "mlp.experts.gate_proj.weight": "experts_gate",
    "mlp.experts.up_proj.weight": "experts_up",
    "mlp.experts.down_proj.weight": "experts_down",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
}


def shard_weights(config: LlamaConfig, theta: Theta, plan: ParallelPlan, *, experts: str = "ffn") -> list[list[StageWeights]]:
    """``result[stage][replica]``: the stage's weights on that replica's device group, the
    stacked experts split as ``experts`` says (a key of :data:`EXPERT_SPLITS`)."""
    check_tp(config, plan.tp)
    check_experts(config, experts, plan.tp)
    split_dim = {**_SPLIT_DIM, **EXPERT_SPLITS[experts]}
    head = theta["model.embed_tokens.weight"] if config.tie_word_embeddings else theta["lm_head.weight"]
    out = []
    for s in range(plan.pp):
        reps = []
        for group in plan.replicas[s]:
            blocks = {}
            for b in plan.blocks_of(s):
                sub = theta.subtree(f"model.layers.{b}")
                blocks[b] = {
                    _SHORT[k]: _place(v, split_dim.get(k), group, f"model.layers.{b}.{k}") for k, v in sub.items() if k in _SHORT
                }
            last = s == plan.pp - 1
            reps.append(
                StageWeights(
                    devices=group,
                    blocks=blocks,
                    embed=_place(theta["model.embed_tokens.weight"], None, group, "model.embed_tokens.weight") if s == 0 else None,
                    norm=_place(theta["model.norm.weight"], None, group, "model.norm.weight") if last else None,
                    lm_head=_place(head, 0, group, "lm_head.weight") if last else None,
                )
            )
        out.append(reps)
    return out
