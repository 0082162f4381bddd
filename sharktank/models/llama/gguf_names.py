"""The Llama-family tensors in a llama.cpp GGUF: their names and the q/k row order.

llama.cpp names tensors ``token_embd.weight``, ``blk.<i>.attn_q.weight``... (the same in the
``llama``, ``qwen2``, ``qwen3`` and ``qwen3moe`` architectures, Qwen3 adding
``attn_q_norm``/``attn_k_norm``, mixtures of experts ``ffn_gate_inp`` and the stacked 3-D
``ffn_{gate,up,down}_exps``);
this maps them to and from the Hugging Face names the model uses (:mod:`.layout`). For the
``llama`` architecture llama.cpp stores the attn_q/attn_k weights (and biases) with each
head's rows interleaved for its pairwise rotary embedding; for qwen2/qwen3 it keeps them as
Hugging Face does (:mod:`.families`). :func:`interleave_rotary` converts between the two row
orders where the family needs it, for plain tensors and for quantized blocks (the rows are
whole blocks).
"""

from __future__ import annotations

import re

from ...types import QuantizedTensor
from .config import LlamaConfig

__all__ = ["ROPE_FREQS", "to_gguf_name", "to_hf_name", "is_rotary", "interleave_rotary"]

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's llama3 rope scaling, one divisor per frequency
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",  # qwen3
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router, and its stacked experts
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_ROTARY = re.compile(r"\.(q|k)_proj\.(weight|bias)$")  # the tensors interleave_rotary reorders
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def to_gguf_name(hf: str) -> str:
    """The llama.cpp name of the Hugging Face tensor ``hf`` (ValueError if it has none)."""
    if hf in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"no GGUF name for {hf!r}")
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def to_hf_name(gguf: str) -> str | None:
    """The Hugging Face name of the llama.cpp tensor ``gguf``, or None for one Llama lacks."""
    for hf, g in _GLOBAL_NAMES.items():
        if g == gguf:
            return hf
    m = _GGUF_LAYER.fullmatch(gguf)
    if m is None:
        return None
    for hf_mid, g_mid in _LAYER_NAMES.items():
        if g_mid == m.group(2):
            return f"model.layers.{m.group(1)}.{hf_mid}.{m.group(3)}"
    return None


def is_rotary(hf: str, config: LlamaConfig) -> bool:
    """Whether a GGUF of ``config``'s architecture stores the Hugging Face tensor ``hf`` in
    another row order (q and k of the ``llama`` architecture)."""
    return config.family.gguf_rotary_interleaved and _ROTARY.search(hf) is not None


def interleave_rotary(name: str, t, config: LlamaConfig, *, to_gguf: bool):
    """Reorder the rows of each q/k head of the Hugging Face tensor ``name`` between the HF
    layout and llama.cpp's (``to_gguf``: HF -> llama.cpp); other tensors, and every tensor of
    an architecture llama.cpp stores unpermuted, are returned as they are.

    HF keeps a head's rotary pairs as (row j, row j + head_dim/2); llama.cpp keeps them
    adjacent (rows 2j, 2j+1).
    """
    if not is_rotary(name, config):
        return t
    heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
    half = config.head_dim // 2
    split = (heads, 2, half) if to_gguf else (heads, half, 2)
    if isinstance(t, QuantizedTensor):  # rows are whole blocks: reorder the block rows
        b = t.blocks
        return t.with_blocks(b.reshape(*split, *b.shape[1:]).transpose(1, 2).reshape(b.shape))
    return t.reshape(*split, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
