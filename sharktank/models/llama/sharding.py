"""Tensor-parallel sharding of Llama weights, placed on each stage's device groups.

Column-parallel (split on the output dim, 0): q/k/v projections, gate and up (and their biases).
Row-parallel (split on the input dim, 1): o and down; their outputs are partial sums that
the layers all-reduce. Mixture-of-experts blocks: the router is replicated and every expert
is split as the dense FFN (stacked gate/up on their ffn dim 1, down on its ffn dim 2), so one
all-reduce combines the experts' partial sums (``layers.moe``); or, expert-parallel, the
expert dim is split over the same group (:data:`EXPERT_SPLITS`), again with one all-reduce.
Expert parallelism alone (``dense="replicated"``): only the experts are split (on the expert
dim); every other weight, the LM head included, is replicated on every device of the group,
so attention runs whole on each device over a replicated KV cache, and a block's one
collective is the all-reduce that combines the experts' partial sums.
Replicated: norms and the token embedding, and Qwen3's q/k norms (one
``[head_dim]`` weight shared by every head: each device applies it to the heads it holds).
The LM head is split on the vocabulary (column-parallel) and gathered at the end. KV heads
are split across the tensor-parallel group, so ``tp`` must divide ``num_kv_heads``
(replicating KV heads is not supported). Every weight is pinned to its device group; activations are not.

Cut sizes are ``torch.tensor_split``'s, with one exception: the FFN's intermediate dim is cut
where a quantized down weight's blocks allow (whole blocks per device, the first devices one
block more where an even cut would fall inside a block, refused only with fewer blocks than
devices), and gate and up take the same sizes. o's input is cut by heads; a quantized o whose
per-device inputs are not whole blocks is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...parallel import ParallelPlan, PlanError
from ...types import QuantizedTensor, ReplicatedTensor, SplitPrimitiveTensor, split_sizes
from ...types.sharded import split_sizes_of
from ...weights import Theta
from .config import LlamaConfig

__all__ = ["DENSE_SPLITS", "EXPERT_SPLITS", "StageWeights", "shard_weights", "check_tp", "check_experts"]

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


# How the weights other than the experts are placed on a stage's device group: "split" (tensor
# parallelism: attention by heads, the dense FFN by its intermediate dim, the LM head by the
# vocabulary) or "replicated" (expert parallelism alone: each device holds them whole).
DENSE_SPLITS = ("split", "replicated")


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


def check_experts(config: LlamaConfig, experts: str, tp: int, dense: str = "split") -> None:
    """Refuse an unknown expert or dense split, an expert-parallel one whose group size does
    not divide E, or replicated dense weights without expert parallelism (which would make
    every device compute the whole model)."""
    if experts not in EXPERT_SPLITS:
        raise PlanError(f"expert split {experts!r} is not known; known: {', '.join(EXPERT_SPLITS)}")
    if dense not in DENSE_SPLITS:
        raise PlanError(f"dense split {dense!r} is not known; known: {', '.join(DENSE_SPLITS)}")
    if dense == "replicated" and experts != "experts":
        raise PlanError("replicated dense weights go with expert parallelism (experts='experts'): without it every device would compute the whole model")
    if experts == "experts" and not config.is_moe:
        raise PlanError("expert parallelism needs a mixture-of-experts model; this one has a dense FFN per block")
    if experts == "experts" and config.num_experts % tp:
        raise PlanError(f"ep={tp}: num_experts={config.num_experts} is not divisible by {tp} (whole experts per device)")


# The FFN's intermediate dim is cut once per block, where its row-parallel down weight can
# be cut (whole blocks of a quantized down: uneven where an even cut falls inside a block),
# and gate, up and their biases take the same sizes so that the shards line up.
_FFN_CUTS = {
    "mlp.down_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "mlp.experts.down_proj.weight": ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight"),
}
# o's input is the attention's output, split by heads as q's rows are: its cut is fixed.
_HEAD_CUT = "self_attn.o_proj.weight"


def _cut_sizes(sub: Theta, split_dim: dict[str, int], n: int, prefix: str) -> dict[str, list[int]]:
    """Shard sizes of the weights of one block whose cut another weight decides: name -> sizes."""
    sizes = {}
    for down, members in _FFN_CUTS.items():
        if down in sub and down in split_dim:
            cut = split_sizes_of(sub[down], split_dim[down], n, f"{prefix}.{down}")
            sizes.update({k: cut for k in (down, *members) if k in sub})
    if _HEAD_CUT in sub:
        o = sub[_HEAD_CUT]
        cut = split_sizes(o.shape[1], n)
        bs = o.layout.block_size if isinstance(o, QuantizedTensor) else 1
        if any(z % bs for z in cut):
            raise PlanError(
                f"{prefix}.{_HEAD_CUT}: tp={n} splits its {o.shape[1]} inputs by heads into {cut}, which cuts "
                f"{o.layout.name}'s blocks of {bs} values (a quantized o needs a multiple of {bs} inputs per device)"
            )
        sizes[_HEAD_CUT] = cut
    return sizes


def _place(t: torch.Tensor, split_dim: int | None, devices: tuple[int, ...], name: str, sizes: list[int] | None = None):
    """``t`` replicated, or split on ``split_dim`` (into ``sizes``, default :func:`split_sizes_of`'s)."""
    if split_dim is None:
        return ReplicatedTensor(ts=t, devices=devices, pinned=True, name=name)
    ts = t if sizes is None else list(t.split(sizes, split_dim))
    return SplitPrimitiveTensor(shard_dim=split_dim, ts=ts, devices=devices, pinned=True, name=name)


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


def shard_weights(
    config: LlamaConfig, theta: Theta, plan: ParallelPlan, *, experts: str = "ffn", dense: str = "split"
) -> list[list[StageWeights]]:
    """``result[stage][replica]``: the stage's weights on that replica's device group, the
    stacked experts split as ``experts`` says (a key of :data:`EXPERT_SPLITS`) and the other
    weights as ``dense`` does (of :data:`DENSE_SPLITS`)."""
    check_experts(config, experts, plan.tp, dense)
    if dense == "split":
        check_tp(config, plan.tp)
    split_dim = {**(_SPLIT_DIM if dense == "split" else {}), **EXPERT_SPLITS[experts]}
    head_dim = 0 if dense == "split" else None
    head = theta["model.embed_tokens.weight"] if config.tie_word_embeddings else theta["lm_head.weight"]
    out = []
    for s in range(plan.pp):
        reps = []
        for group in plan.replicas[s]:
            blocks = {}
            for b in plan.blocks_of(s):
                sub = theta.subtree(f"model.layers.{b}")
                sizes = _cut_sizes(sub, split_dim, len(group), f"model.layers.{b}")
                blocks[b] = {
                    _SHORT[k]: _place(v, split_dim.get(k), group, f"model.layers.{b}.{k}", sizes.get(k))
                    for k, v in sub.items() if k in _SHORT
                }
            last = s == plan.pp - 1
            reps.append(
                StageWeights(
                    devices=group,
                    blocks=blocks,
                    embed=_place(theta["model.embed_tokens.weight"], None, group, "model.embed_tokens.weight") if s == 0 else None,
                    norm=_place(theta["model.norm.weight"], None, group, "model.norm.weight") if last else None,
                    lm_head=_place(head, head_dim, group, "lm_head.weight") if last else None,
                )
            )
        out.append(reps)
    return out
