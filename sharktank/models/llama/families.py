"""The members of the Llama family this model runs, and what tells them apart.

A family is data, one row each: the name llama.cpp gives it (``general.architecture`` of its
GGUF files and the prefix of their metadata keys), the Hugging Face ``model_type`` values it
loads from (dense, and mixture-of-experts ones), whether llama.cpp's converter stores its q/k
rows interleaved, whether it has Qwen3's per-head q/k RMSNorm, how its q/k/v and o biases
follow ``attention_bias``, and how its mixture-of-experts blocks route tokens (the
``ROUTINGS`` of :mod:`sharktank.layers.moe`). Everything else (shapes, rope, biases present,
expert counts) is the config's.

Mixtral converts to ``llama`` (llama.cpp writes it as a llama file with ``expert_count``);
Qwen3-MoE is llama.cpp's ``qwen3moe``, whose blocks are all mixtures of experts.

llama.cpp's converter permutes q/k only for ``llama`` (its rope there pairs adjacent dims);
``qwen2``, ``qwen3`` and ``qwen3moe`` use the NEOX rope, which pairs dims ``j`` and ``j + head_dim/2`` as
Hugging Face does, and are written unpermuted. Mistral checkpoints convert to ``llama``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "family", "family_of_model_type"]


@dataclass(frozen=True)
class Family:
    """One member of the Llama family (see the module docstring)."""

    name: str
    hf_model_types: tuple[str, ...]  # dense checkpoints of this family
    gguf_rotary_interleaved: bool  # llama.cpp stores each q/k head's rotary pairs adjacent
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before rotary
    qkv_bias: bool | None = None  # q/k/v biases whatever attention_bias says (None: it decides)
    o_bias: bool | None = None  # likewise for the o_proj bias
    hf_moe_model_types: tuple[str, ...] = ()  # mixture-of-experts checkpoints of this family
    routing: str | None = None  # its MoE routing rule (a key of layers.moe.ROUTINGS); None: dense only
    experts_required: bool = False  # every block is a mixture of experts (no dense member)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # Mixtral: softmax over the k largest router logits.
        Family("llama", ("llama", "mistral"), gguf_rotary_interleaved=True, hf_moe_model_types=("mixtral",), routing="topk_softmax"),
        # transformers' Qwen2 always has q/k/v biases and never an o bias.
        Family("qwen2", ("qwen2",), gguf_rotary_interleaved=False, qkv_bias=True, o_bias=False),
        Family("qwen3", ("qwen3",), gguf_rotary_interleaved=False, qk_norm=True),
        # Qwen3-MoE: softmax over all experts, the k largest kept (renormalised by norm_topk_prob).
        Family("qwen3moe", (), gguf_rotary_interleaved=False, qk_norm=True, hf_moe_model_types=("qwen3_moe",), routing="softmax_topk", experts_required=True),
    )
}


def family(name: str) -> Family:
    """The family named ``name`` (its GGUF architecture); ValueError naming the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"architecture {name!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_model_type(model_type: str) -> Family:
    """The family a Hugging Face ``config.json`` ``model_type`` (dense or MoE) loads as."""
    for f in FAMILIES.values():
        if model_type in f.hf_model_types + f.hf_moe_model_types:
            return f
    known = ", ".join([t for f in FAMILIES.values() for t in f.hf_model_types] + [t for f in FAMILIES.values() for t in f.hf_moe_model_types])
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {known}")
