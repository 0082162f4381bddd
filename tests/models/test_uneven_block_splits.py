"""Row-parallel splits of quantized weights whose even cut would fall inside a block: split
unevenly at block boundaries (``torch.tensor_split`` sizes of the blocks), the FFN's gate, up
and down alike so that its shards line up, and refused only with fewer blocks than shards.
The oracle is the unsharded model on the gguf package's dequantized weights."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from quantized_models import TOKENS, compiled_vs_eager, gguf_dequantized, stored_as, typed_theta
from sharktank.models import load_model, save_gguf
from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.model import LlamaModel
from sharktank.parallel import ParallelPlan, PlanError
from sharktank.types import LAYOUTS, QuantizationError, SplitPrimitiveTensor, split_sizes
from sharktank.types.sharded import split_sizes_of

# Q8_0 with an FFN of 160: 5 blocks of 32, which tp 2 cannot halve.
Q8_CONFIG = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
                        rms_norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64)
# K-quants with an FFN of 1280: 5 blocks of 256 (Q4_K gate/up, Q6_K down), attention in Q8_0
# so that tp 4's o (128 inputs per device) is whole blocks.
K_CONFIG = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1280, num_layers=1, num_heads=8, num_kv_heads=4,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64)


def _q8_0(name, shape):
    return "Q8_0"


def _k_mix(name, shape):
    return {"gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}.get(name.split(".")[-2], "Q8_0")


def _weight(kind: str, rows: int, cols: int):
    return stored_as(kind, torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.05, seed=3)


@given(blocks=st.integers(1, 80), count=st.integers(1, 8), kind=st.sampled_from(["Q8_0", "Q4_K"]))
def test_block_split_sizes_are_tensor_split_sizes_of_whole_blocks(blocks, count, kind):
    bs = LAYOUTS[kind].block_size
    w = _weight(kind, 2, blocks * bs)
    if blocks < count:
        with pytest.raises(QuantizationError, match=rf"w1: cannot split {kind} \[2, {blocks * bs}\] into {count} shards .* "
                                                    rf"{blocks} blocks \(blocks hold {bs} values each\), fewer than the shards"):
            split_sizes_of(w, 1, count, "w1")
        return
    sizes = split_sizes_of(w, 1, count)
    assert sizes == [bs * n for n in split_sizes(blocks, count)]
    assert sum(sizes) == w.shape[1] and all(z % bs == 0 for z in sizes) and max(sizes) - min(sizes) <= bs
    if blocks % count == 0:  # where the even cut falls between blocks, it is the even cut
        assert sizes == split_sizes(w.shape[1], count)
    assert split_sizes_of(w, 0, count) == split_sizes(2, count)  # rows: any count, as plain tensors
    t = SplitPrimitiveTensor(shard_dim=1, ts=w, shard_count=count)
    assert t.shard_sizes == sizes and torch.equal(torch.cat([s.dequantize() for s in t.shards], 1), w.dequantize())


def test_the_issue_examples_split_unevenly_at_blocks():
    assert SplitPrimitiveTensor(shard_dim=1, ts=_weight("Q8_0", 2, 160), shard_count=2).shard_sizes == [96, 64]
    # Qwen2.5-7B's FFN of 18944 in Q4_K at tp 4: 74 blocks of 256.
    sizes = split_sizes_of(_weight("Q4_K", 1, 18944), 1, 4)
    assert sizes == [19 * 256, 19 * 256, 18 * 256, 18 * 256]


def _file(tmp_path, config, type_of, name):
    path = tmp_path / f"{name}.gguf"
    save_gguf(path, config, typed_theta(config, type_of))
    return path


def _reference(path, config):
    loaded = load_model(path).source.theta
    model = LlamaModel(config, gguf_dequantized(loaded), ParallelPlan.from_tp_pp(config.num_layers, 1, 1))
    return model.prefill(TOKENS), model.generate(TOKENS[:1], 4)


def _ffn_sizes(model, block: int = 0) -> dict[str, list[int]]:
    weights = model.stages[0][0].blocks[block]
    return {k: weights[k].shard_sizes for k in ("gate", "up", "down")}


@pytest.mark.parametrize("config, type_of, cuts", [
    (Q8_CONFIG, _q8_0, {2: [96, 64]}),
    (K_CONFIG, _k_mix, {2: [768, 512], 4: [512, 256, 256, 256]}),
], ids=["q8_0-ffn160", "k-quants-ffn1280"])
def test_uneven_block_splits_equal_the_unsharded_model(tmp_path, config, type_of, cuts):
    path = _file(tmp_path, config, type_of, "uneven")
    want, want_ids = _reference(path, config)
    for tp, sizes in cuts.items():
        model = load_model(path, tp=tp)
        assert _ffn_sizes(model) == {"gate": sizes, "up": sizes, "down": sizes}
        got = model.prefill(TOKENS)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, f"tp={tp}: max |error| / max |logit| = {err:.3g}"
        assert torch.equal(model.generate(TOKENS[:1], 4), want_ids), f"tp={tp}"


@pytest.mark.parametrize("experts", ["ffn", "experts"])
def test_uneven_block_splits_of_stacked_experts(experts):
    # Each Q8_0 expert's ffn of 96 (3 blocks) splits [64, 32] at tp 2, gate/up (dim 1) as down
    # (dim 2); expert parallelism splits the expert dim instead, whole experts per device.
    from sharktank.models.llama.presets import random_theta
    from sharktank.weights import Theta

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                         architecture="qwen3moe", num_experts=4, num_experts_per_tok=2)
    theta = Theta({n: stored_as("Q8_0", t, seed=i) if ".experts." in n else t for i, (n, t) in enumerate(random_theta(config, seed=5).items())})
    oracle = LlamaModel(config, gguf_dequantized(theta), ParallelPlan.from_tp_pp(1, 1, 1))
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(1, 2, 1), experts=experts)
    weights = model.stages[0][0].blocks[0]
    sizes = {"ffn": [64, 32], "experts": [2, 2]}[experts]
    assert {k: weights[k].shard_sizes for k in ("experts_gate", "experts_up", "experts_down")} == dict.fromkeys(
        ("experts_gate", "experts_up", "experts_down"), sizes)
    want, got = oracle.prefill(TOKENS), model.prefill(TOKENS)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"max |error| / max |logit| = {err:.3g}"
    assert torch.equal(model.generate(TOKENS[:1], 4), oracle.generate(TOKENS[:1], 4))


def test_fewer_blocks_than_shards_is_refused_naming_the_tensor(tmp_path):
    config = dataclasses.replace(K_CONFIG, intermediate_size=768)  # 3 blocks of 256
    path = _file(tmp_path, config, _k_mix, "few")
    assert _ffn_sizes(load_model(path, tp=2)) == {"gate": [512, 256], "up": [512, 256], "down": [512, 256]}
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: cannot split Q6_K \[512, 768\] into 4 shards "
                                                r".* 3 blocks \(blocks hold 256 values each\), fewer than the shards"):
        load_model(path, tp=4)


def test_a_quantized_o_is_cut_by_heads_or_refused(tmp_path):
    # o's inputs are the attention's heads: tp 4 gives each device 128, half a Q4_K block.
    path = _file(tmp_path, K_CONFIG, lambda n, s: "Q4_K" if "o_proj" in n else _k_mix(n, s), "o")
    assert load_model(path, tp=2).stages[0][0].blocks[0]["o"].shard_sizes == [256, 256]
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: tp=4 splits its 512 inputs by heads into "
                                        r"\[128, 128, 128, 128\], which cuts Q4_K's blocks of 256 values"):
        load_model(path, tp=4)


_GLOBAL = re.compile(r'util\.global private @"__auto\.([^"]+)".*?: tensor<([^>]+)>')


def test_uneven_q8_0_ffn_compiled_at_tp2_equals_eager(tmp_path):
    from sharktank.export.artifact import export_artifact
    from sharktank.runtime import CompiledModel

    config = dataclasses.replace(Q8_CONFIG, num_layers=1)
    path = _file(tmp_path, config, _q8_0, "q8_0")
    out = tmp_path / "art"
    # exact_prompts: the prompt's products as eager's (the bfloat16 prefill dispatches have their own test,
    # tests/export/test_prefill_kernels.py), so that 1e-4 checks the sharding and the decode kernels.
    export_artifact(load_model(path, tp=2, deferred=True), out, source=str(path), max_seq_len=32, exact_prompts=True, functions=("prefill", "decode"))
    # down's shards are held as they are cut: 3 and 2 blocks of 34 bytes per row.
    shapes = sorted(shape.rsplit("x", 1)[0] for name, shape in _GLOBAL.findall((out / "model.mlir").read_text()) if "down_proj" in name)
    assert shapes == ["128x2x34", "128x3x34"], shapes
    model = load_model(path, tp=2)
    compiled = CompiledModel(out)
    prefill, err = compiled_vs_eager(compiled, model)
    assert prefill <= 1e-4, f"prefill: max |error| / max |logit| = {prefill:.3g}"
    assert err <= 1e-4, f"decode: max |error| / max |logit| = {err:.3g}"
