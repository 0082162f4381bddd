"""Built-in model presets with deterministic seeded random weights (no file needed)."""

from __future__ import annotations

import torch

from ...weights import Theta
from .config import LlamaConfig

__all__ = ["PRESETS", "PRESET_DTYPES", "random_theta"]

PRESETS: dict[str, LlamaConfig] = {
    # Small enough for tests and CI, with grouped KV heads that tp 1, 2 and 4 divide.
    "toy-llama": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=128,
    ),
    # Exactly the shapes of the public sharktank package's toy Llama, for side-by-side figures.
    "toy-llama-3l": LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=23,
        num_layers=3,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        rms_norm_eps=0.01,
        rope_theta=500000.0,
        max_seq_len=128,
    ),
}

# The dtype a preset's weights are made in (float32 unless listed).
PRESET_DTYPES: dict[str, torch.dtype] = {"toy-llama-3l": torch.float16}


def random_theta(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Theta:
    """Seeded random weights in the Hugging Face layout (the same seed gives the same bits)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    hd = c.head_dim

    def w(*shape, scale=0.05):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    def norm():
        return (1.0 + 0.1 * torch.randn((c.hidden_size,), generator=g)).to(dtype)

    t = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size, scale=1.0)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(c.num_heads * hd, c.hidden_size)
        t[p + "self_attn.k_proj.weight"] = w(c.num_kv_heads * hd, c.hidden_size)
        t[p + "self_attn.v_proj.weight"] = w(c.num_kv_heads * hd, c.hidden_size)
        if c.attention_bias:
            t[p + "self_attn.q_proj.bias"] = w(c.num_heads * hd)
            t[p + "self_attn.k_proj.bias"] = w(c.num_kv_heads * hd)
            t[p + "self_attn.v_proj.bias"] = w(c.num_kv_heads * hd)
        t[p + "self_attn.o_proj.weight"] = w(c.hidden_size, c.num_heads * hd)
        if c.o_bias:
            t[p + "self_attn.o_proj.bias"] = w(c.hidden_size)
        t[p + "mlp.gate_proj.weight"] = w(c.intermediate_size, c.hidden_size)
        t[p + "mlp.up_proj.weight"] = w(c.intermediate_size, c.hidden_size)
        t[p + "mlp.down_proj.weight"] = w(c.hidden_size, c.intermediate_size)
        if c.mlp_bias:
            t[p + "mlp.gate_proj.bias"] = w(c.intermediate_size)
            t[p + "mlp.up_proj.bias"] = w(c.intermediate_size)
            t[p + "mlp.down_proj.bias"] = w(c.hidden_size)
        t[p + "input_layernorm.weight"] = norm()
        t[p + "post_attention_layernorm.weight"] = norm()
    t["model.norm.weight"] = norm()
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = w(c.vocab_size, c.hidden_size, scale=0.2)
    return Theta(t)
