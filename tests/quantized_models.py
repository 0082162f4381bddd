"""Quantized test models: a small Llama whose 2-D weights are Q8_0 (gguf's quantizer) or a
Q4_K/Q6_K mix as in Q4_K_M files (valid blocks built directly: gguf has no K-quant
quantizer), and the same model dequantized by the gguf package (the oracle)."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.presets import random_theta
from sharktank.types import LAYOUTS, QuantizedTensor
from sharktank.weights import Theta

# Inputs of 512 so that tp 2's row-parallel halves (256) are whole K-quant blocks.
CONFIG = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=4,
                     rms_norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64)
TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))


def _k_blocks(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid K-quant blocks (gguf has no K-quant quantizer): random quants and sub-block
    scales, with float16 super-block scales small enough for weights of about 0.1."""
    layout = LAYOUTS[name]
    rng = np.random.default_rng(seed)
    n = rows * cols // layout.block_size
    raw = rng.integers(0, 256, size=(n, layout.block_bytes), dtype=np.uint8)
    scale = {"Q4_K": 2e-4, "Q6_K": 3e-5}[name]
    for off in {"Q4_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,)}[name]:  # d (and dmin) as float16 bytes
        d = (rng.uniform(0.5, 1.0, n) * scale).astype(np.float16)
        raw[:, off : off + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(n, 2)
    return torch.from_numpy(raw)


# Where each layout's blocks hold float16 numbers: d (and dmin, or m), as byte offsets.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,)}


def signed_blocks(layout: str, n: int, k: int, seed: int, scale: float) -> QuantizedTensor:
    """A weight ``[n, k]`` of random valid blocks: any bytes, except the float16 numbers,
    kept finite and about ``scale``: positive, negative and (one in ten) zero, as real files
    have them."""
    lay, rng = LAYOUTS[layout], np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // lay.block_size, lay.block_bytes), dtype=np.uint8)
    for at in SCALE_OFFSETS[layout]:
        sign = rng.choice([-1.0, 0.0, 1.0], size=raw.shape[:2], p=[0.45, 0.1, 0.45])
        d = (sign * rng.uniform(0.5, 1.0, raw.shape[:2])).astype(np.float16) * np.float16(scale)
        raw[..., at : at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return QuantizedTensor(lay, (n, k), torch.from_numpy(raw))


def quantized_theta(kind: str, config: LlamaConfig = CONFIG) -> Theta:
    theta = dict(random_theta(config, seed=5))
    for i, (name, t) in enumerate(theta.items()):
        if t.ndim != 2:
            continue  # norms stay float32, as in llama.cpp's files
        if kind == "q8_0":
            raw = gguf.quants.quantize(t.numpy(), GGMLQuantizationType.Q8_0)
            theta[name] = QuantizedTensor("Q8_0", t.shape, torch.from_numpy(raw.copy()))
        else:  # Q4_K_M-like: Q6_K for the value and down projections and the head, Q4_K elsewhere
            layout = "Q6_K" if any(k in name for k in ("v_proj", "down_proj", "lm_head")) else "Q4_K"
            theta[name] = QuantizedTensor(layout, t.shape, _k_blocks(layout, *t.shape, seed=i))
    return Theta(theta)


def gguf_dequantized(theta: Theta) -> Theta:
    """Every quantized weight expanded by the gguf package, not by our code."""
    def expand(t):
        if not isinstance(t, QuantizedTensor):
            return t
        blocks = t.blocks.reshape(t.shape[0], -1).numpy()
        return torch.from_numpy(gguf.quants.dequantize(blocks, GGMLQuantizationType[t.layout.name]).astype(np.float32)).reshape(t.shape)

    return theta.map(lambda _, t: expand(t))


# --- Files as llama.cpp writes them: a type per tensor --------------------------------------

# Where the K-quants keep their float16 super-block scales, and a size for them that gives
# weights of about 0.1 (random sub-block scales and quants).
_K_SCALES = {"Q4_K": ((0, 2), 2e-4), "Q5_K": ((0, 2), 1e-4), "Q6_K": ((208,), 3e-5)}


def k_blocks(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid ``name`` blocks (Q4_K, Q5_K or Q6_K) of a ``[rows, cols]`` weight: random quants
    and sub-block scales, float16 super-block scales of both signs (as real files have them)."""
    layout = LAYOUTS[name]
    offsets, scale = _K_SCALES[name]
    rng = np.random.default_rng(seed)
    n = rows * cols // layout.block_size
    raw = rng.integers(0, 256, size=(n, layout.block_bytes), dtype=np.uint8)
    for off in offsets:
        d = (rng.uniform(0.5, 1.0, n) * rng.choice([-1.0, 1.0], n) * scale).astype(np.float16)
        raw[:, off : off + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(n, 2)
    return torch.from_numpy(raw)


def stored_as(kind: str, t: torch.Tensor, seed: int):
    """``t`` as a file stores it in ggml type ``kind``: F32/F16 as is, the legacy types by gguf's
    quantizer, the K-quants as valid random blocks (gguf has no K-quant quantizer)."""
    if kind in ("F32", "F16"):
        return t.to({"F32": torch.float32, "F16": torch.float16}[kind])
    if kind in _K_SCALES:
        return QuantizedTensor(kind, t.shape, k_blocks(kind, *t.shape, seed=seed))
    raw = gguf.quants.quantize(t.numpy(), GGMLQuantizationType[kind])
    return QuantizedTensor(kind, t.shape, torch.from_numpy(raw.copy()))


def typed_theta(config: LlamaConfig, type_of, seed: int = 5) -> Theta:
    """A random model whose 2-D weights are stored as ``type_of(name, shape)`` says (a ggml type
    name, see :func:`stored_as`); norms stay float32, as in llama.cpp's files."""
    theta = dict(random_theta(config, seed=seed))
    for i, (name, t) in enumerate(theta.items()):
        if t.ndim == 2:
            theta[name] = stored_as(type_of(name, tuple(t.shape)), t, seed=i)
    return Theta(theta)


def llama_cpp_type(name: str, shape, base: str = "Q4_K") -> str:
    """The type llama.cpp's Q4_K_M quantizer gives a weight of ``shape`` (simplified): Q8_0
    embedding, F16 output here (as ``--output-tensor-type f16`` writes it), Q6_K for v and
    down in the first block (its ``use_more_bits`` layers), ``base`` elsewhere; a weight whose
    rows are not whole 256-value blocks falls back to a legacy type as its quantizer does
    (Q6_K -> Q8_0, Q4_K -> Q5_0, Q5_K -> Q5_1)."""
    if name == "model.embed_tokens.weight":
        return "Q8_0"
    if name == "lm_head.weight":
        return "F16"
    kind = "Q6_K" if name.startswith("model.layers.0.") and any(k in name for k in ("v_proj", "down_proj")) else base
    if shape[-1] % 256:
        kind = {"Q6_K": "Q8_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1"}[kind]
    return kind


def compiled_vs_eager(compiled, model, *, new_tokens: int = 4) -> tuple[float, float]:
    """``(prefill, decode)``: the largest |compiled - eager| over the largest |logit| of a
    prefill of ``TOKENS[:1]`` and of ``new_tokens`` greedy decode steps after it (on the
    compiled module's own path); the greedy ids must be equal (asserted here)."""
    prompt = TOKENS[:1]
    got, _ = compiled.prefill(prompt)
    want = model.prefill(prompt)
    prefill = ((got - want).abs().max() / want.abs().max()).item()
    ids, steps = compiled.generate(prompt, new_tokens)
    assert torch.equal(ids, model.generate(prompt, new_tokens))
    want = model.prefill(torch.cat([prompt, ids[:, :-1]], 1))[:, prompt.shape[1] - 1 :]
    decode = ((steps - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    return prefill, decode
