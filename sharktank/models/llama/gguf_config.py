"""A LlamaConfig as llama.cpp's GGUF metadata, and back: ``general.architecture`` is the
config's family (``llama``, ``qwen2``, ``qwen3`` or ``qwen3moe``) and prefixes every model key
(``qwen3.block_count``...). Mixtures of experts add ``expert_count`` and ``expert_used_count``
(a Mixtral file is ``llama`` with them); ``qwen3moe`` keeps its expert size under
``expert_feed_forward_length`` and its ``norm_topk_prob`` as ``expert_weights_norm``.

llama3 rope scaling has no llama.cpp metadata keys: llama.cpp's converter bakes it into a
``rope_freqs`` tensor of per-frequency divisors, which loads as a config with
``rope_scaling={"rope_type": "factors", "factors": [...]}`` (the same frequencies). Our
writer keeps llama3's own parameters under ``sharktank.rope_scaling.*`` instead, and writes
``rope_freqs`` for a "factors" config. What the tensors are (biases, tied embeddings, the
vocabulary size) is read from the tensors present, as llama.cpp does. A file whose
``<arch>.attention.sliding_window`` is shorter than its context is refused, as Hugging Face
configs with one are (:meth:`LlamaConfig.from_hf`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ...weights import GgufTensor, WeightsError
from .config import LlamaConfig
from .gguf_names import ROPE_FREQS

__all__ = ["gguf_metadata", "rope_freqs_array", "config_from_gguf"]

_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_SCALING_PREFIX = "sharktank.rope_scaling."


def gguf_metadata(config: LlamaConfig) -> dict[str, tuple[str, Any]]:
    """The GGUF metadata of ``config``: key -> (GGUFWriter value kind, value)."""
    arch = config.architecture
    m: dict[str, tuple[str, Any]] = {
        f"{arch}.vocab_size": ("uint32", config.vocab_size),
        f"{arch}.context_length": ("uint32", config.max_seq_len),
        f"{arch}.embedding_length": ("uint32", config.hidden_size),
        f"{arch}.block_count": ("uint32", config.num_layers),
        f"{arch}.feed_forward_length": ("uint32", config.intermediate_size),
        f"{arch}.attention.head_count": ("uint32", config.num_heads),
        f"{arch}.attention.head_count_kv": ("uint32", config.num_kv_heads),
        f"{arch}.attention.key_length": ("uint32", config.head_dim),
        f"{arch}.attention.value_length": ("uint32", config.head_dim),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", config.rms_norm_eps),
        f"{arch}.rope.freq_base": ("float32", config.rope_theta),
        f"{arch}.rope.dimension_count": ("uint32", config.head_dim),
    }
    if config.is_moe:
        m[f"{arch}.expert_count"] = ("uint32", config.num_experts)
        m[f"{arch}.expert_used_count"] = ("uint32", config.num_experts_per_tok)
        if config.family.routing == "softmax_topk":  # qwen3moe: the expert size under its own key
            m[f"{arch}.expert_feed_forward_length"] = ("uint32", config.intermediate_size)
            m[f"{arch}.expert_weights_norm"] = ("bool", config.norm_topk_prob)
    if config.rope_scaling is not None and config.rope_scaling["rope_type"] != "factors":  # factors: a rope_freqs tensor
        m[_SCALING_PREFIX + "type"] = ("string", config.rope_scaling["rope_type"])
        for k in _SCALING_KEYS:
            m[_SCALING_PREFIX + k] = ("float64", float(config.rope_scaling[k]))
    return m


def rope_freqs_array(config: LlamaConfig) -> np.ndarray | None:
    """The ``rope_freqs`` tensor a "factors" config is stored with (None for any other config)."""
    if config.rope_scaling is None or config.rope_scaling["rope_type"] != "factors":
        return None
    # As llama.cpp's converter stores llama3 scaling: one divisor per rotary frequency.
    return np.asarray(config.rope_scaling["factors"], dtype=np.float32)


def config_from_gguf(path, fields: Mapping[str, Any], tensors: Mapping[str, GgufTensor], rope_freqs: GgufTensor | None) -> LlamaConfig:
    """The config described by a GGUF's metadata ``fields`` (of one of the family's
    architectures: ``general.architecture`` names it), its ``tensors`` (by Hugging Face name)
    and its ``rope_freqs`` tensor, if any. A missing key or values that describe no such
    model raise :class:`WeightsError` naming ``path``."""
    arch = fields["general.architecture"]

    def need(key: str) -> Any:
        if key not in fields:
            raise WeightsError(f"metadata key {key!r} is missing", path=path)
        return fields[key]

    if "model.embed_tokens.weight" not in tensors:
        raise WeightsError("missing", path=path, tensor="token_embd.weight")
    hidden, heads = int(need(f"{arch}.embedding_length")), int(need(f"{arch}.attention.head_count"))
    scaling = None
    if _SCALING_PREFIX + "type" in fields:
        scaling = {"rope_type": fields[_SCALING_PREFIX + "type"]}
        scaling.update({k: need(_SCALING_PREFIX + k) for k in _SCALING_KEYS})
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    elif rope_freqs is not None:
        # llama.cpp's converter writes Llama 3.1+'s llama3 scaling as these factors alone.
        scaling = {"rope_type": "factors", "factors": _rope_factors(path, rope_freqs, fields)}
    elif any(k.startswith(f"{arch}.rope.scaling.") for k in fields):
        kind = fields.get(f"{arch}.rope.scaling.type", "?")
        raise WeightsError(f"rope scaling {kind!r} is not supported (supported: llama3, as sharktank.rope_scaling.* keys or a {ROPE_FREQS} tensor)", path=path)
    context = int(need(f"{arch}.context_length"))
    window = fields.get(f"{arch}.attention.sliding_window")
    if window is not None and int(window) < context:
        raise WeightsError(f"sliding-window attention is not supported: {arch}.attention.sliding_window={int(window)} is smaller than {arch}.context_length={context}", path=path)
    experts = _experts(path, arch, fields)
    try:
        config = LlamaConfig(
            vocab_size=tensors["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(fields.get(f"{arch}.expert_feed_forward_length") or need(f"{arch}.feed_forward_length")),
            num_layers=int(need(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=_f32_decimal(need(f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=_f32_decimal(fields.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=context,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
            o_bias="model.layers.0.self_attn.o_proj.bias" in tensors,
            mlp_bias="model.layers.0.mlp.gate_proj.bias" in tensors,
            tie_word_embeddings="lm_head.weight" not in tensors,
            architecture=arch,
            **experts,
        )
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise WeightsError(f"metadata does not describe a {arch} model: {e}", path=path) from None
    rotary = fields.get(f"{arch}.rope.dimension_count", config.head_dim)
    if int(rotary) != config.head_dim:
        raise WeightsError(f"{arch}.rope.dimension_count={int(rotary)}: rotary embedding of part of a head is not supported (head_dim {config.head_dim})", path=path)
    return config


def _rope_factors(path, info: GgufTensor, fields: Mapping[str, Any]) -> list[float]:
    """The per-frequency divisors of a ``rope_freqs`` tensor, checked against the head size."""
    arch = fields["general.architecture"]
    key_length = fields.get(f"{arch}.attention.key_length") or fields.get(f"{arch}.rope.dimension_count")
    if key_length is None:
        key_length = int(fields[f"{arch}.embedding_length"]) // int(fields[f"{arch}.attention.head_count"])
    want = int(key_length) // 2
    if info.dtype != torch.float32 or info.shape != (want,):
        raise WeightsError(f"is {info.dtype} {list(info.shape)}; expected float32 [{want}] (one factor per rotary frequency)", path=path, tensor=ROPE_FREQS)
    factors = info.read(path)
    if not bool((factors > 0).all()) or not bool(factors.isfinite().all()):
        raise WeightsError("holds a factor that is not a positive finite number", path=path, tensor=ROPE_FREQS)
    return [float(f) for f in factors]


def _experts(path, arch: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The expert fields of a mixture-of-experts file (``{arch}.expert_count`` > 0), else {}.
    Without ``expert_weights_norm`` the kept weights are renormalised, as llama.cpp's
    graphs for these architectures do."""
    count = int(fields.get(f"{arch}.expert_count", 0))
    if not count:
        return {}
    used = int(fields.get(f"{arch}.expert_used_count", 0))
    if not 1 <= used <= count:
        raise WeightsError(f"{arch}.expert_used_count={used} must be in 1..{arch}.expert_count={count}", path=path)
    return {"num_experts": count, "num_experts_per_tok": used, "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm", True))}


def _f32_decimal(value: float) -> float:
    # The GGUF keys are float32: 1e-6 comes back as 9.99999997e-07. Take the shortest
    # decimal that rounds to the same float32, i.e. the number that was written.
    return float(str(np.float32(value)))
