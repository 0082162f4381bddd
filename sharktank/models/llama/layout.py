"""The Hugging Face Llama tensor layout a config implies: names and shapes (with Qwen3's
q/k norms when its family has them).

A mixture-of-experts block holds its router as ``mlp.gate.weight`` ``[E, hidden]`` (Qwen3-MoE's
name) and its experts stacked on a leading expert dim, ``mlp.experts.{gate,up,down}_proj.weight``
(``[E, ffn, hidden]``, ``[E, ffn, hidden]``, ``[E, hidden, ffn]``): one tensor per kind, as
llama.cpp stores them and as the model gathers them. Hugging Face checkpoints hold one
tensor per expert; their loader stacks them (:mod:`.hf_checkpoint`).

Every Llama file format loads into this layout and is checked against it
(:func:`layout_problem`), whatever names the file itself uses.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .config import LlamaConfig

__all__ = ["llama_shapes", "layout_problem"]


def llama_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a Llama model with ``config`` has, name -> shape, in model order."""
    h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.family.qk_norm:  # Qwen3: one [head_dim] weight for every q head, one for every k head
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if config.is_moe:
            e = config.num_experts
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_proj.weight"] = (e, ffn, h)
            shapes[p + "mlp.experts.up_proj.weight"] = (e, ffn, h)
            shapes[p + "mlp.experts.down_proj.weight"] = (e, h, ffn)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
            shapes[p + "mlp.up_proj.weight"] = (ffn, h)
            shapes[p + "mlp.down_proj.weight"] = (h, ffn)
        if config.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (ffn,)
            shapes[p + "mlp.up_proj.bias"] = (ffn,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def layout_problem(found: Mapping[str, Sequence[int]], config: LlamaConfig) -> tuple[str, str] | None:
    """The first disagreement of ``found`` (name -> shape) with ``config``, as (name, reason).

    Missing tensors are reported first, then wrong shapes, then unexpected names.
    """
    if config.num_layers > len(found):
        # Every layer has several tensors, so these layers cannot all be there. Report the first
        # missing one without listing them all: one flipped bit in a GGUF block_count claims
        # 2**26 layers, and building their names took a minute and all memory.
        layer = next(i for i in range(config.num_layers) if f"model.layers.{i}.input_layernorm.weight" not in found)
        return f"model.layers.{layer}.input_layernorm.weight", f"missing (the config has {config.num_layers} layers)"
    expected = llama_shapes(config)
    for name in expected:
        if name not in found:
            return name, "missing"
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            return name, f"shape {list(found[name])} disagrees with the config, which implies {list(shape)}"
    for name in found:
        if name not in expected:
            return name, "unexpected for this config (not a parameter of the model it describes)"
    return None
