"""Llama-family hyperparameters (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts
Mixtral and Qwen3-MoE: see :mod:`.families`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .families import FAMILIES, Family, family, family_of_model_type

__all__ = ["LlamaConfig"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # default hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or the llama3 variant: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_seq_len: int = 2048
    attention_bias: bool = False  # q/k/v biases (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # o_proj bias (Llama's attention_bias; not Qwen2)
    mlp_bias: bool = False  # gate/up/down biases (Llama's mlp_bias)
    tie_word_embeddings: bool = False
    architecture: str = "llama"  # the family (llama.cpp's name for it): llama, qwen2, qwen3 or qwen3moe
    # Mixture of experts (0: a dense SwiGLU FFN per block). With experts, intermediate_size is
    # one expert's; the family's routing rule picks num_experts_per_tok of them per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True  # renormalise the kept weights to sum 1 (softmax_topk routing)

    def __post_init__(self) -> None:
        family(self.architecture)  # refuses an unknown one, naming the known
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, found {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        self._check_experts()

    def _check_experts(self) -> None:
        fam = family(self.architecture)
        e, k = self.num_experts, self.num_experts_per_tok
        if not e:
            if fam.experts_required:
                raise ValueError(f"architecture {self.architecture!r} is a mixture of experts: num_experts must be >= 1, found 0")
            return
        if fam.routing is None:
            raise ValueError(f"architecture {self.architecture!r} has no mixture-of-experts form (num_experts={e}); MoE families: "
                             + ", ".join(f.name for f in FAMILIES.values() if f.routing))
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok={k} must be in 1..num_experts={e}")
        if self.mlp_bias:
            raise ValueError("mlp_bias with experts is not supported (no MoE family has expert biases)")
        if fam.routing == "topk_softmax" and not self.norm_topk_prob:
            raise ValueError(f"{self.architecture}'s routing (softmax over the chosen logits) always sums to 1: norm_topk_prob must be True")

    @property
    def is_moe(self) -> bool:
        """Whether each block's FFN is a mixture of experts."""
        return self.num_experts > 0

    @property
    def family(self) -> Family:
        """What this config's architecture adds to the Llama layout (q/k norms, GGUF q/k order)."""
        return family(self.architecture)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        return cls(**d)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dict (``model_type`` llama, mistral, qwen2, qwen3,
        mixtral or qwen3_moe; llama when absent). Sliding-window attention is refused (see
        :func:`_sliding_window`), as are Qwen3-MoE configs with dense blocks among the MoE ones."""
        model_type = d.get("model_type", "llama")
        fam = family_of_model_type(model_type)
        moe = _experts(d) if model_type in fam.hf_moe_model_types else {}
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"unsupported rope scaling {kind!r}; supported: llama3")
            scaling = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
            scaling["rope_type"] = "llama3"
        heads = d["num_attention_heads"]
        max_positions = d.get("max_position_embeddings", 2048)
        window = _sliding_window(d)
        if window is not None and window < max_positions:
            raise ValueError(
                f"sliding-window attention is not supported: sliding_window={window} is smaller than "
                f"max_position_embeddings={max_positions} (a query past position {window - 1} would see only the "
                f"last {window} keys; this model attends to all of them)"
            )
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=moe.pop("intermediate_size", None) or d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=max_positions,
            attention_bias=attention_bias if fam.qkv_bias is None else fam.qkv_bias,
            o_bias=attention_bias if fam.o_bias is None else fam.o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            architecture=fam.name,
            **moe,
        )


def _experts(d: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of a Mixtral or Qwen3-MoE ``config.json`` (Qwen3-MoE's expert size is
    ``moe_intermediate_size``; its ``intermediate_size`` is for dense blocks, refused here)."""
    experts = d.get("num_local_experts") or d.get("num_experts")
    if not experts or not d.get("num_experts_per_tok"):
        raise ValueError(f"model_type {d.get('model_type')!r} needs num_local_experts (or num_experts) and num_experts_per_tok")
    out = {"num_experts": experts, "num_experts_per_tok": d["num_experts_per_tok"]}
    if d.get("model_type") == "qwen3_moe":
        dense = d.get("mlp_only_layers") or []
        step = d.get("decoder_sparse_step", 1)
        if dense or step != 1:
            raise ValueError(
                f"dense blocks among the MoE ones are not supported: mlp_only_layers={dense}, decoder_sparse_step={step} "
                "(expected [] and 1: every block a mixture of experts)"
            )
        out["intermediate_size"] = d["moe_intermediate_size"]
        out["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
    return out


def _sliding_window(d: dict[str, Any]) -> int | None:
    """The attention window of a Hugging Face config, if any of its layers uses one.

    ``layer_types`` (transformers 5 writes it) says which layers slide. Without it, Qwen2/Qwen3
    slide only with ``use_sliding_window`` and only from layer ``max_window_layers`` (28 by
    default) on, as transformers builds them; Mistral slides in every layer when
    ``sliding_window`` is set.
    """
    window = d.get("sliding_window")
    if window is None:
        return None
    if d.get("layer_types") is not None:
        return window if "sliding_attention" in d["layer_types"] else None
    if d.get("model_type") in ("qwen2", "qwen3", "qwen3_moe"):
        slides = d.get("use_sliding_window", False) and d.get("max_window_layers", 28) < d["num_hidden_layers"]
        return window if slides else None
    return window
