"""Tensor-parallel sharding of Llama weights, placed on each stage's device groups.

Column-parallel (split on the output dim, 0): q/k/v projections, gate and up (and their biases).
Row-parallel (split on the input dim, 1): o and down; their outputs are partial sums that
the layers all-reduce. Replicated: norms and the token embedding, and Qwen3's q/k norms (one
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

__all__ = ["StageWeights", "shard_weights", "check_tp"]

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
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
}


def shard_weights(config: LlamaConfig, theta: Theta, plan: ParallelPlan) -> list[list[StageWeights]]:
    """``result[stage][replica]``: the stage's weights on that replica's device group."""
    check_tp(config, plan.tp)
    head = theta["model.embed_tokens.weight"] if config.tie_word_embeddings else theta["lm_head.weight"]
    out = []
    for s in range(plan.pp):
        reps = []
        for group in plan.replicas[s]:
            blocks = {}
            for b in plan.blocks_of(s):
                sub = theta.subtree(f"model.layers.{b}")
                blocks[b] = {
                    _SHORT[k]: _place(v, _SPLIT_DIM.get(k), group, f"model.layers.{b}.{k}") for k, v in sub.items() if k in _SHORT
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
