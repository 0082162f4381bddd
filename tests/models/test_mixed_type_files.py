"""GGUF files as llama.cpp's quantizer writes them: a type per tensor (the embedding and the
output in types of their own), and legacy types where a tensor's rows are not whole 256-value
K-quant blocks. They load with every tensor's type as written, run eagerly equal to the same
model on the gguf package's dequantized weights, and compile at tp 2 equal to eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantized_models import TOKENS, compiled_vs_eager, gguf_dequantized, llama_cpp_type, typed_theta
from sharktank.models import load_model, save_gguf
from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.model import LlamaModel
from sharktank.parallel import ParallelPlan
from sharktank.types import QuantizedTensor

CONFIG = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=512, num_layers=1, num_heads=8, num_kv_heads=4,
                     rms_norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64)

# Every tensor its own type: K-quants of three kinds in the block, a Q8_0 embedding, an F16 output.
MIXED = {
    "model.embed_tokens.weight": "Q8_0",
    "lm_head.weight": "F16",
    "model.layers.0.self_attn.q_proj.weight": "Q4_K",
    "model.layers.0.self_attn.k_proj.weight": "Q5_K",
    "model.layers.0.self_attn.v_proj.weight": "Q6_K",
    "model.layers.0.self_attn.o_proj.weight": "Q4_K",
    "model.layers.0.mlp.gate_proj.weight": "Q5_K",
    "model.layers.0.mlp.up_proj.weight": "Q4_K",
    "model.layers.0.mlp.down_proj.weight": "Q6_K",
}

# Rows that K-quants cannot hold: an FFN of 288 (down's rows: 9 blocks of 32, which also split
# unevenly at tp 2), or a hidden size of 384 (every input of the hidden size), as in SmolLM2's 576.
FALLBACKS = {
    "ffn288": dataclasses.replace(CONFIG, intermediate_size=288, num_layers=2),
    "hidden384": LlamaConfig(vocab_size=64, hidden_size=384, intermediate_size=512, num_layers=2, num_heads=6, num_kv_heads=2,
                             rms_norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64),
}


def _types(theta) -> dict[str, str]:
    """Tensor name -> its stored type (a layout name, or F32/F16)."""
    plain = {torch.float32: "F32", torch.float16: "F16"}
    return {n: t.layout.name if isinstance(t, QuantizedTensor) else plain[t.dtype] for n, t in theta.items()}


def _oracle(path, config):
    """The unsharded model on the gguf package's dequantized weights (F16 widened to float32,
    exactly): its logits and greedy ids."""
    loaded = load_model(path).source.theta
    dense = gguf_dequantized(loaded).map(lambda _, t: t.float())
    model = LlamaModel(config, dense, ParallelPlan.from_tp_pp(config.num_layers, 1, 1))
    return model.prefill(TOKENS), model.generate(TOKENS[:1], 4)


def _check_eager(path, config, tps):
    want, want_ids = _oracle(path, config)
    for tp in tps:
        model = load_model(path, tp=tp)
        got = model.prefill(TOKENS)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, f"tp={tp}: max |error| / max |logit| = {err:.3g}"
        assert torch.equal(model.generate(TOKENS[:1], 4), want_ids), f"tp={tp}"


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    save_gguf(path, CONFIG, typed_theta(CONFIG, lambda name, shape: MIXED[name]))
    return path


def test_a_mixed_type_file_loads_each_tensor_as_written_and_equals_gguf(mixed_file):
    loaded = load_model(mixed_file).source.theta
    norms = {n: "F32" for n in loaded if n.endswith("norm.weight")}
    assert _types(loaded) == {**MIXED, **norms}
    _check_eager(mixed_file, CONFIG, tps=(1, 2))


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_legacy_fallbacks_load_and_equal_gguf(tmp_path, name):
    config = FALLBACKS[name]
    path = tmp_path / f"{name}.gguf"
    save_gguf(path, config, typed_theta(config, llama_cpp_type))
    types = _types(load_model(path).source.theta)
    for n, t in types.items():
        if n.endswith("norm.weight") or n in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        rows = config.intermediate_size if "down_proj" in n else config.hidden_size
        # A K-quant only where rows are whole 256-value blocks; llama.cpp's legacy fallbacks elsewhere.
        assert t in (("Q4_K", "Q6_K") if rows % 256 == 0 else ("Q5_0", "Q8_0")), (n, t)
    assert {"Q5_0", "Q8_0"} <= set(types.values())
    _check_eager(path, config, tps=(1, 2))


def test_a_mixed_type_file_compiled_at_tp2_equals_eager(mixed_file, tmp_path):
    from sharktank.export.artifact import export_artifact
    from sharktank.runtime import CompiledModel

    out = tmp_path / "art"
    # exact_prompts: the prompt's products as eager's (the bfloat16 prefill dispatches have their own test,
    # tests/export/test_prefill_kernels.py), so that 1e-4 checks the sharding and the decode kernels.
    export_artifact(load_model(mixed_file, tp=2, deferred=True), out, source=str(mixed_file), max_seq_len=32, exact_prompts=True, functions=("prefill", "decode"))
    model = load_model(mixed_file, tp=2)
    compiled = CompiledModel(out)
    prefill, err = compiled_vs_eager(compiled, model)
    assert prefill <= 1e-4, f"prefill: max |error| / max |logit| = {prefill:.3g}"
    # The Q4_K and Q6_K decode kernels take x rounded to 16 bits per 32 values (as in
    # tests/export/test_quantized_export.py's bound for a Q4_K_M mix).
    assert err <= 5e-3, f"decode: max |error| / max |logit| = {err:.3g}"
