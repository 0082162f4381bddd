"""Mixture-of-experts GGUF files as llama.cpp's Q4_K_M quantizer writes them: the stacked
experts ``ffn_{gate,up}_exps`` in Q4_K and ``ffn_down_exps`` in Q6_K (3-D, ``[E, rows,
cols]`` of 256-value blocks). Such a file loads, and the model computes on the blocks what
the model built from the gguf package's dequantization of them computes: unsharded,
tensor-parallel (each expert's ffn split in whole blocks) and expert-parallel, in the
prefill (grouped) and decode (gathered) forms, eager and compiled."""

from __future__ import annotations

import functools

import pytest
import torch

from quantized_models import gguf_dequantized, k_blocks
from reference import logits_error
from sharktank.models import load_gguf, save_gguf
from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.model import LlamaModel
from sharktank.models.llama.presets import random_theta
from sharktank.parallel import ParallelPlan
from sharktank.types import QuantizedTensor
from sharktank.weights import Theta

# Hidden 256: gate/up rows are one Q4_K block. Down rows are Mixtral's two Q6_K blocks (ffn
# 512: tp 2 cuts each expert's ffn 256 + 256) or, as in Qwen3-30B-A3B (moe_intermediate_size
# 768), three (tp 2 cuts 512 + 256: an uneven cut between blocks).
_COMMON = dict(vocab_size=64, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, rms_norm_eps=1e-6,
               rope_theta=1e6, max_seq_len=64)
CONFIGS = {
    "mixtral": LlamaConfig(**_COMMON, intermediate_size=512, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": LlamaConfig(**_COMMON, intermediate_size=768, head_dim=32, architecture="qwen3moe", num_experts=8,
                             num_experts_per_tok=2),
}
# Q4_K_M's types for the stacked experts (down: Q6_K in its use_more_bits layers, which this
# test takes for every layer).
EXPERT_TYPES = {"gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}
TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))
# Logits of the quantized model against the dequantized one: eagerly both multiply the same
# float32 values (ours expand the blocks as gguf's do, bit for bit), so only the order of
# float32 sums may differ (an uneven tp cut of the quantized ffn against an even one of the
# float ffn: measured 6.5e-7; 0 elsewhere).
TOLERANCE = 1e-6


def kquant_theta(kind: str, config: LlamaConfig | None = None) -> Theta:
    """A random ``kind`` model (of ``config``, default its own) whose stacked experts are valid random Q4_K / Q6_K blocks (gguf
    has no K-quant quantizer), the rest float32; the router scaled by 10, so that top-k
    choices are far from ties that rounding could flip."""
    theta = dict(random_theta(config or CONFIGS[kind], seed=7))
    for i, (name, t) in enumerate(theta.items()):
        if name.endswith("mlp.gate.weight"):
            theta[name] = t * 10.0
        elif ".mlp.experts." in name:
            layout = EXPERT_TYPES[name.split(".")[-2]]
            theta[name] = QuantizedTensor(layout, t.shape, k_blocks(layout, t.shape[0] * t.shape[1], t.shape[2], seed=i))
    return Theta(theta)


@functools.lru_cache(maxsize=None)
def _written(kind: str, directory: str):
    path = f"{directory}/{kind}.gguf"
    save_gguf(path, CONFIGS[kind], kquant_theta(kind))
    return path


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """``kind -> path`` of the GGUF of :func:`kquant_theta`, written on first use."""
    directory = str(tmp_path_factory.mktemp("kquant"))
    return lambda kind: _written(kind, directory)


def decode_logits(model: LlamaModel, prompt: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, n, vocab]`` of decode steps of the tokens ``steps`` ``[B, n]`` after ``prompt``."""
    b, s = prompt.shape
    cache = model.new_cache(b, s + steps.shape[1])
    model.prefill(prompt, cache)
    out = [model.decode(steps[:, i], cache, torch.full((b,), s + i)) for i in range(steps.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_kquant_experts_load_as_written(kquant_gguf, kind):
    config, theta = load_gguf(kquant_gguf(kind))
    assert config == CONFIGS[kind]
    e, f, h = config.num_experts, config.intermediate_size, config.hidden_size
    want = kquant_theta(kind)
    for proj, layout in EXPERT_TYPES.items():
        t = theta[f"model.layers.1.mlp.experts.{proj}.weight"]
        assert isinstance(t, QuantizedTensor) and t.layout.name == layout
        assert t.shape == ((e, h, f) if proj == "down_proj" else (e, f, h))
        assert t.equal(want[f"model.layers.1.mlp.experts.{proj}.weight"])


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("tp, experts", [(1, "ffn"), (2, "ffn"), (2, "experts")])
def test_kquant_experts_equal_their_dequantized_weights(kquant_gguf, kind, tp, experts):
    # Prefill of 12 tokens (24 pairs >= E): grouped by expert; decode of one token (2 pairs < E):
    # the chosen experts read in place, per device too where its experts outnumber the pairs
    # (ep 2: Qwen3-MoE's 4 per device; Mixtral's 2 per device are grouped).
    config, theta = load_gguf(kquant_gguf(kind))
    plan = ParallelPlan.from_tp_pp(config.num_layers, tp, 1)
    model = LlamaModel(config, theta, plan, experts=experts)
    down = model.stages[0][0].blocks[1]["experts_down"]
    assert all(isinstance(d, QuantizedTensor) and d.layout.name == "Q6_K" for d in getattr(down, "shards", [down]))
    oracle = LlamaModel(config, gguf_dequantized(theta), plan, experts=experts)
    prefill = logits_error(model.prefill(TOKENS), oracle.prefill(TOKENS))
    prompt, steps = TOKENS[:1, :5], TOKENS[:1, 5:9]
    decode = logits_error(decode_logits(model, prompt, steps), decode_logits(oracle, prompt, steps))
    assert prefill <= TOLERANCE and decode <= TOLERANCE, f"prefill {prefill:.3g}, decode {decode:.3g}"


def test_compiled_kquant_experts_equal_eager(kquant_gguf, tmp_path):
    # Qwen3-MoE (k=2 of E=8) for the CPU. exact_prompts: a prompt's products are eager's dense
    # product of the dequantized weight (the default bfloat16 prefill dispatches move the logits
    # by about 2e-3, their own tests' bound), so the prefill bound checks the MoE program itself:
    # float32 sums in another order. A decode step's products are the Q4_K / Q6_K CPU kernels,
    # which take x rounded to 16-bit integers per 32 values (relative error about 2^-15 per
    # value): measured 1.8e-5 of the logits, bounded at 1e-4.
    import re

    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model
    from sharktank.runtime import CompiledModel
    from test_moe_compiled import _function

    path = kquant_gguf("qwen3_moe")
    out = tmp_path / "art"
    export_artifact(load_model(path, deferred=True), out, source=path, max_seq_len=32, functions=("prefill", "decode"), exact_prompts=True,
                    batch_sizes=(1, 4))
    mlir = (out / "model.mlir").read_text()
    decode = _function(mlir, "decode_bs1")
    # The decode step reads its two chosen experts' blocks in place: the K-quant kernels'
    # stacked form takes the whole [8, rows, blocks, bytes] blocks and each pair's index, both
    # pairs in one call (3 weights x 2 layers calls). No expert is sliced at a data offset
    # (which IREE copies before a dispatch reads it) or gathered, and no index is read back
    # (Tensor.item).
    calls = re.findall(r"util\.call @(sharktank_\w+_product_e8\w+)\(", decode)
    assert len(calls) == 3 * 2
    assert set(calls) == {"sharktank_q4_k_product_e8p2_1x768x256_i16", "sharktank_q6_k_product_e8p2_1x256x768_i16"}
    assert not re.search(r"torch\.aten\.narrow %\S+, %int0\S*, %\S+, %int1\S* : !torch\.vtensor<\[8,", decode)
    assert not re.search(r"index_select %\S+, %\S+, %\S+ : !torch\.vtensor<\[8,", mlir)
    assert "torch.aten.item" not in decode

    compiled, model = CompiledModel(out), load_model(path)
    prompt = TOKENS[:1]
    got, _ = compiled.prefill(prompt)
    prefill = logits_error(got, model.prefill(prompt))
    assert prefill <= 1e-5, f"prefill: max |error| / max |logit| = {prefill:.3g}"
    ids, steps = compiled.generate(prompt[:, :6], 6)
    assert torch.equal(ids, model.generate(prompt[:, :6], 6))
    want = model.prefill(torch.cat([prompt[:, :6], ids[:, :-1]], 1))[:, 5:]
    decode = logits_error(steps, want)
    assert decode <= 1e-4, f"decode: max |error| / max |logit| = {decode:.3g}"
    # A batch of 4 (8 pairs over 8 experts: each expert read once through the kernels for
    # all four rows, weighted). Before 98e5960 this form dequantized the stacked blocks for a
    # batched product, and compiled it generated other ids than eager here (this test at
    # 30a518f; a Mixtral-shaped Q8_0 model's batch-4 logits were off by 1.77, the largest 2.69).
    prompts = TOKENS[:, :12].reshape(4, 6)
    ids, steps = compiled.generate(prompts, 4)
    assert torch.equal(ids, model.generate(prompts, 4))
    want = model.prefill(torch.cat([prompts, ids[:, :-1]], 1))[:, 5:]
    batched = logits_error(steps, want)
    assert batched <= 1e-4, f"batch-4 decode: max |error| / max |logit| = {batched:.3g}"


def test_a_one_block_expert_ffn_is_not_split():
    # ffn 256 is one Q6_K block per down row: tp 2 cannot cut each expert's ffn between
    # blocks; the refusal names the tensor and its type. Whole experts per device still work.
    import dataclasses

    from sharktank.types import QuantizationError

    config = dataclasses.replace(CONFIGS["mixtral"], intermediate_size=256)
    theta = kquant_theta("mixtral", config)
    plan = ParallelPlan.from_tp_pp(config.num_layers, 2, 1)
    with pytest.raises(QuantizationError, match=r"^model\.layers\.0\.mlp\.experts\.down_proj\.weight: cannot split Q6_K \[4, 256, 256\] into 2 shards along its last dim"):
        LlamaModel(config, theta, plan)
    LlamaModel(config, theta, plan, experts="experts")
