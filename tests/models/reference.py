"""Reference models from transformers, built from a config with random weights."""

from __future__ import annotations

import functools

import torch

from sharktank.models.llama import LlamaConfig
from sharktank.weights import Theta


@functools.lru_cache(maxsize=None)
def hf_llama(num_layers: int = 4, rope_scaling: bool = False, qwen: bool = False, seed: int = 0, kv_heads: int = 4, biases: bool = False):
    """(transformers model, our config, theta) for a small random Llama (or Qwen2) model."""
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    if rope_scaling:
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500000.0,
        }
        kwargs["rope_theta"] = 500000.0
    if qwen:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs, tie_word_embeddings=False))
    else:
        if biases:  # Llama with attention_bias (q, k, v and o) and mlp_bias
            kwargs.update(attention_bias=True, mlp_bias=True)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    model.eval()
    # Non-trivial norm weights and biases (transformers starts biases at zero), so that one
    # applied wrongly, or not at all, shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    config = LlamaConfig.from_hf(model.config.to_dict())
    theta = Theta({k: v.detach().clone() for k, v in model.state_dict().items() if "rotary" not in k})
    return model, config, theta
