"""The CPU kernels of the layouts added after Q8_0, Q4_K and Q6_K (Q4_0, Q4_1, Q5_0, Q5_1,
Q5_K, Q3_K) in a whole model: a one-layer Llama whose every 2-D weight takes one of them, exported
for this CPU (decode's products call the kernels: the manifest's ``cpu_kernels`` says so),
compiled, and its prefill and decode logits against the eager model's.

The float-x kernels (legacy layouts) differ from eager only in summation order; Q5_K's takes
x rounded to 16 bits per 32 values (export/kernels/int16_x), as Q4_K's does, and so does Q3_K's."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from quantized_models import CONFIG, compiled_vs_eager
from sharktank.export.artifact import export_artifact
from sharktank.export.kernels import INTEGER_DOT
from sharktank.models import load_model, save_gguf
from sharktank.models.llama.presets import random_theta
from sharktank.runtime import CompiledModel
from sharktank.types import QuantizedTensor
from sharktank.weights import Theta

ONE_LAYER = dataclasses.replace(CONFIG, num_layers=1)
# Each projection its own legacy layout (gguf's quantizer makes their blocks).
LEGACY = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q5_0", "o_proj": "Q5_1", "gate_proj": "Q4_1", "up_proj": "Q5_0",
          "down_proj": "Q4_0", "lm_head": "Q5_1", "embed_tokens": "Q8_0"}


# K-quant blocks the tests draw (gguf has no K-quant quantizer): bytes a block, where its float16
# scales are, and their size for weights of about 0.1.
K_BLOCKS = {"Q5_K": (176, (0, 2), 1e-4), "Q3_K": (110, (108,), 8e-4)}


def _k_blocks(layout: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid blocks of a K-quant layout: random values and sub-block scales (and mins), with
    float16 scales of either sign (some 0)."""
    block_bytes, offsets, scale = K_BLOCKS[layout]
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    raw = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for off in offsets:
        d = (rng.choice([-1.0, 0.0, 1.0], n, p=[0.45, 0.1, 0.45]) * rng.uniform(0.5, 1.0, n) * scale).astype(np.float16)
        raw[:, off : off + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(n, 2)
    return torch.from_numpy(raw)


def _theta(kind: str) -> Theta:
    theta = dict(random_theta(ONE_LAYER, seed=5))
    for i, (name, t) in enumerate(theta.items()):
        if t.ndim != 2:
            continue  # norms stay float32, as in llama.cpp's files
        layout = next(v for k, v in LEGACY.items() if k in name)
        if kind in ("q5_k", "q3_k") and "embed" not in name and "lm_head" not in name:
            theta[name] = QuantizedTensor(kind.upper(), t.shape, _k_blocks(kind.upper(), *t.shape, seed=i))
        else:
            raw = gguf.quants.quantize(t.numpy(), GGMLQuantizationType[layout])
            theta[name] = QuantizedTensor(layout, t.shape, torch.from_numpy(raw.copy()))
    return Theta(theta)


CASES = {  # kind: (the kernels its decode calls, the bound on decode's logits)
    "legacy": (["q4_0", "q4_1", "q5_0", "q5_1"], 1e-4),
    "q5_k": (["q5_1", "q5_k"] if INTEGER_DOT else ["q5_1"], 1e-3),
    "q3_k": (["q3_k", "q5_1"] if INTEGER_DOT else ["q5_1"], 1e-3),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_compiled_decode_with_the_kernels_matches_eager(tmp_path, kind):
    path = tmp_path / f"{kind}.gguf"
    save_gguf(path, ONE_LAYER, _theta(kind))
    out = tmp_path / "art"
    # exact_prompts: the prompt's products as eager's (the bfloat16 prefill dispatches have their own test,
    # tests/export/test_prefill_kernels.py), so that 1e-4 checks the sharding and the decode kernels.
    manifest = export_artifact(load_model(path, tp=1, deferred=True), out, source=str(path), max_seq_len=32, exact_prompts=True, functions=("prefill", "decode"))
    kernels, bound = CASES[kind]
    # The embedding is a lookup, not a product: its Q8_0 takes no kernel.
    assert manifest.module["cpu_kernels"] == ["decode_attention", *kernels]
    model, compiled = load_model(path, tp=1), CompiledModel(out)
    prefill, err = compiled_vs_eager(compiled, model)
    assert prefill <= 1e-4, f"prefill: max |error| / max |logit| = {prefill:.3g}"
    assert err <= bound, f"decode: max |error| / max |logit| = {err:.3g}"
