"""Built-in model presets with deterministic seeded random weights (no file needed)."""

from __future__ import annotations

import torch

from ...weights import Theta
from .config import LlamaConfig
from .layout import llama_shapes

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
    """Seeded random weights in the Hugging Face layout (the same seed gives the same bits):
    norms near 1, the embedding at scale 1, the LM head at 0.2, the rest at 0.05."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    for name, shape in llama_shapes(config).items():  # in model order: the draws stay fixed
        if name.endswith("norm.weight"):
            t[name] = (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        else:
            scale = {"model.embed_tokens.weight": 1.0, "lm_head.weight": 0.2}.get(name, 0.05)
            t[name] = (torch.randn(shape, generator=g) * scale).to(dtype)
    return Theta(t)
