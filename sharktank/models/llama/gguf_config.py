"""A LlamaConfig as llama.cpp's GGUF metadata (``llama.*`` keys), and back.

llama3 rope scaling has no llama.cpp metadata keys: llama.cpp's converter bakes it into a
``rope_freqs`` tensor of per-frequency divisors, which loads as a config with
``rope_scaling={"rope_type": "factors", "factors": [...]}`` (the same frequencies). Our
writer keeps llama3's own parameters under ``sharktank.rope_scaling.*`` instead, and writes
``rope_freqs`` for a "factors" config. What the tensors are (biases, tied embeddings, the
vocabulary size) is read from the tensors present, as llama.cpp does.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ...weights import GgufTensor, WeightsError
from .config import LlamaConfig
from .gguf_names import ARCH, ROPE_FREQS

__all__ = ["gguf_metadata", "rope_freqs_array", "config_from_gguf"]

_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_SCALING_PREFIX = "sharktank.rope_scaling."


def gguf_metadata(config: LlamaConfig) -> dict[str, tuple[str, Any]]:
    """The GGUF metadata of ``config``: key -> (GGUFWriter value kind, value)."""
    m: dict[str, tuple[str, Any]] = {
        f"{ARCH}.vocab_size": ("uint32", config.vocab_size),
        f"{ARCH}.context_length": ("uint32", config.max_seq_len),
        f"{ARCH}.embedding_length": ("uint32", config.hidden_size),
        f"{ARCH}.block_count": ("uint32", config.num_layers),
        f"{ARCH}.feed_forward_length": ("uint32", config.intermediate_size),
        f"{ARCH}.attention.head_count": ("uint32", config.num_heads),
        f"{ARCH}.attention.head_count_kv": ("uint32", config.num_kv_heads),
        f"{ARCH}.attention.key_length": ("uint32", config.head_dim),
        f"{ARCH}.attention.value_length": ("uint32", config.head_dim),
        f"{ARCH}.attention.layer_norm_rms_epsilon": ("float32", config.rms_norm_eps),
        f"{ARCH}.rope.freq_base": ("float32", config.rope_theta),
        f"{ARCH}.rope.dimension_count": ("uint32", config.head_dim),
    }
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
    """The config described by a llama GGUF's metadata ``fields``, its ``tensors`` (by Hugging
    Face name) and its ``rope_freqs`` tensor, if any. A missing key or values that describe no
    Llama model raise :class:`WeightsError` naming ``path``."""

    def need(key: str) -> Any:
        if key not in fields:
            raise WeightsError(f"metadata key {key!r} is missing", path=path)
        return fields[key]

    if "model.embed_tokens.weight" not in tensors:
        raise WeightsError("missing", path=path, tensor="token_embd.weight")
    hidden, heads = int(need(f"{ARCH}.embedding_length")), int(need(f"{ARCH}.attention.head_count"))
    scaling = None
    if _SCALING_PREFIX + "type" in fields:
        scaling = {"rope_type": fields[_SCALING_PREFIX + "type"]}
        scaling.update({k: need(_SCALING_PREFIX + k) for k in _SCALING_KEYS})
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    elif rope_freqs is not None:
        # llama.cpp's converter writes Llama 3.1+'s llama3 scaling as these factors alone.
        scaling = {"rope_type": "factors", "factors": _rope_factors(path, rope_freqs, fields)}
    elif any(k.startswith(f"{ARCH}.rope.scaling.") for k in fields):
        kind = fields.get(f"{ARCH}.rope.scaling.type", "?")
        raise WeightsError(f"rope scaling {kind!r} is not supported (supported: llama3, as sharktank.rope_scaling.* keys or a {ROPE_FREQS} tensor)", path=path)
    try:
        return LlamaConfig(
            vocab_size=tensors["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(need(f"{ARCH}.feed_forward_length")),
            num_layers=int(need(f"{ARCH}.block_count")),
            num_heads=heads,
            num_kv_heads=int(fields.get(f"{ARCH}.attention.head_count_kv", heads)),
            head_dim=int(fields.get(f"{ARCH}.attention.key_length", hidden // heads)),
            rms_norm_eps=_f32_decimal(need(f"{ARCH}.attention.layer_norm_rms_epsilon")),
            rope_theta=_f32_decimal(fields.get(f"{ARCH}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=int(need(f"{ARCH}.context_length")),
            attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
            o_bias="model.layers.0.self_attn.o_proj.bias" in tensors,
            mlp_bias="model.layers.0.mlp.gate_proj.bias" in tensors,
            tie_word_embeddings="lm_head.weight" not in tensors,
        )
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise WeightsError(f"metadata does not describe a Llama model: {e}", path=path) from None


def _rope_factors(path, info: GgufTensor, fields: Mapping[str, Any]) -> list[float]:
    """The per-frequency divisors of a ``rope_freqs`` tensor, checked against the head size."""
    key_length = fields.get(f"{ARCH}.attention.key_length") or fields.get(f"{ARCH}.rope.dimension_count")
    if key_length is None:
        key_length = int(fields[f"{ARCH}.embedding_length"]) // int(fields[f"{ARCH}.attention.head_count"])
    want = int(key_length) // 2
    if info.dtype != torch.float32 or info.shape != (want,):
        raise WeightsError(f"is {info.dtype} {list(info.shape)}; expected float32 [{want}] (one factor per rotary frequency)", path=path, tensor=ROPE_FREQS)
    factors = info.read(path)
    if not bool((factors > 0).all()) or not bool(factors.isfinite().all()):
        raise WeightsError("holds a factor that is not a positive finite number", path=path, tensor=ROPE_FREQS)
    return [float(f) for f in factors]


def _f32_decimal(value: float) -> float:
    # The GGUF keys are float32: 1e-6 comes back as 9.99999997e-07. Take the shortest
    # decimal that rounds to the same float32, i.e. the number that was written.
    return float(str(np.float32(value)))
