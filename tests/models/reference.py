"""Reference models from transformers (Llama, Qwen2, Qwen3, Mistral), built from a config with
random weights, and the tolerance our logits are held to against them."""

from __future__ import annotations

import functools

import torch

from sharktank.models.llama import LlamaConfig
from sharktank.weights import Theta

# transformers initialises weights with std 0.02, which makes q.k/sqrt(head_dim) ~0.1: attention
# is nearly uniform (the mean top weight is 0.11 over 48 positions) and a rotary mistake barely
# moves the logits. Scaling q_proj and k_proj by 6 multiplies the scores by 36 (mean top
# weight 0.45), so where each key sits, and hence rotary, decides what a query reads.
QK_SCALE = 6.0
# llama3 scaling: positions reach 48 > 40, and with rope_theta 500000 and head_dim 16 the
# wavelengths are 6.3 (< 40/4: kept), 32.4 (in the blended band [10, 40]) and 167+ (> 40:
# divided by the factor), so all three branches of the scaling are exercised.
LLAMA3_CONTEXT = 40

# Float32 against float32, relative to max|logit|: the correct code's rounding reaches 1.2e-6
# (at every placement the tests use), so 2e-5 leaves room for other CPUs' kernels, while each
# mistake these tests are meant to catch (rope base, llama3 scaling, rotary pairing, decode
# position, a dropped bias) moves the logits by 1e-2 or more (a dropped k bias: 1.1e-2).
LOGITS_RTOL = 2e-5


def logits_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want| (the logit scale)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def assert_logits_match(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` within :data:`LOGITS_RTOL` of the reference logits ``want``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err = logits_error(got, want)
    assert err <= LOGITS_RTOL, f"max |error| / max |logit| = {err:.3g} > {LOGITS_RTOL:g}"


@functools.lru_cache(maxsize=None)
def hf_llama(num_layers: int = 4, rope_scaling: bool = False, qwen: bool = False, seed: int = 0, kv_heads: int = 4, biases: bool = False):
    """(transformers model, our config, theta) for a small random Llama (or Qwen2) model."""
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=64,
        hidden_size=128,  # head_dim 16: eight rotary frequencies
        intermediate_size=192,
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
            "original_max_position_embeddings": LLAMA3_CONTEXT,
            "rope_theta": 500000.0,
        }
        kwargs["rope_theta"] = 500000.0
    if qwen:  # Qwen2 checkpoints use base 1e6, not the config class's default 10000
        kwargs["rope_theta"] = 1000000.0
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs, tie_word_embeddings=False))
    else:
        if biases:  # Llama with attention_bias (q, k, v and o) and mlp_bias
            kwargs.update(attention_bias=True, mlp_bias=True)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    return _prepared(model)


def _prepared(model):
    """``(model, our config, theta)`` after giving ``model`` non-trivial norm weights and
    biases (transformers starts biases at zero), so that one applied wrongly, or not at all,
    shows, and sharp attention (QK_SCALE; QK_NORM_SCALE where q/k are normalized per head)."""
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(QK_NORM_SCALE)
    config = LlamaConfig.from_hf(model.config.to_dict())
    # A tied LM head is the embedding: the theta holds it once, as the checkpoint loaders give it.
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    theta = Theta({k: v.detach().clone() for k, v in model.state_dict().items() if "rotary" not in k and k not in tied})
    return model, config, theta


# Qwen3 normalizes each q and k head (RMS 1 times its norm weight), which undoes QK_SCALE on
# the projections: its scores q.k/sqrt(head_dim) are then about N(0, 1). Scaling both norm
# weights by 2 multiplies the scores by 4: in hf_family("qwen3") the mean top attention
# weight of queries 8..47 is then 0.63 and 0.59 in its two blocks (qwen2 and mistral, with
# QK_SCALE: 0.18 and 0.19; uniform attention over those positions would give about 0.04).
QK_NORM_SCALE = 2.0

# The tiny family references: 2 blocks, hidden 64, 4 heads / 2 KV heads (tp 2 divides them).
# Qwen3's head_dim is 32, twice hidden / heads: its q/k/o shapes and norms see the difference.
FAMILY_KWARGS = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
)


@functools.lru_cache(maxsize=None)
def hf_family(kind: str, tie: bool = False, seed: int = 0, **extra):
    """(transformers model, our config, theta) for a tiny random ``kind`` model: ``qwen2``,
    ``qwen3`` (head_dim 32) or ``mistral``; ``tie``: tied word embeddings; ``extra``: more
    config keys."""
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(FAMILY_KWARGS, tie_word_embeddings=tie, **extra)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=1000000.0, **kwargs))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(rope_theta=1000000.0, head_dim=32, **kwargs))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**kwargs))
    else:
        raise ValueError(f"no reference for {kind!r}; expected qwen2, qwen3 or mistral")
    return _prepared(model)
