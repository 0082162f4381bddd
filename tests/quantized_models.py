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
    for off in {"Q4_K": (0, 2), "Q6_K": (208,)}[name]:  # d (and dmin) as float16 bytes
        d = (rng.uniform(0.5, 1.0, n) * scale).astype(np.float16)
        raw[:, off : off + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(n, 2)
    return torch.from_numpy(raw)


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
