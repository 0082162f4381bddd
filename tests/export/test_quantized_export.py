"""Quantized GGUF weights through export: the archives hold the blocks as the file stores
them, the program dequantizes inside each product (every weight global is a uint8 block
tensor; only the norms are float), and the compiled module gives the eager model's logits."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from quantized_models import CONFIG, TOKENS, quantized_theta
from sharktank.export.artifact import compile_artifact, export_artifact
from sharktank.export.kernels import INTEGER_DOT, kernels_in
from sharktank.models import load_model
from sharktank.runtime import ArtifactError, CompiledModel
from sharktank.models import save_gguf

_GLOBAL = re.compile(r'util\.global private @"__auto\.([^"]+)".*?= #flow\.parameter\.named<"model"::"[^"]+"> : tensor<([^>]+)>')


def _weight_globals(mlir: str) -> dict[str, str]:
    """External weight global name -> its element type."""
    found = {name: shape.split("x")[-1] for name, shape in _GLOBAL.findall(mlir)}
    assert found, "no parameter globals found in the MLIR"
    return found


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    """One block of the mix: enough to compile every dequantizing product for a target."""
    config = dataclasses.replace(CONFIG, num_layers=1)
    path = tmp_path_factory.mktemp("qexport") / "q4_k_m.gguf"
    save_gguf(path, config, quantized_theta("q4_k_m", config))
    return path


@pytest.mark.parametrize("kind, tp, pp", [("q8_0", 2, 1), ("q4_k_m", 2, 2)])
def test_quantized_export_keeps_blocks_and_matches_eager(tmp_path, kind, tp, pp):
    path = tmp_path / f"{kind}.gguf"
    save_gguf(path, CONFIG, quantized_theta(kind))
    out = tmp_path / "art"
    # exact_prompts: the prompt's products as eager's (the bfloat16 prefill dispatches have their own test,
    # tests/export/test_prefill_kernels.py), so that 1e-4 checks the sharding and the decode kernels.
    manifest = export_artifact(load_model(path, tp=tp, pp=pp, deferred=True), out, source=str(path), max_seq_len=32, exact_prompts=True, functions=("prefill", "decode"))
    types = _weight_globals((out / "model.mlir").read_text())
    dense = {n: t for n, t in types.items() if t not in ("i8", "ui8")}
    # No full-precision copy of a quantized weight: only the (float32) norms are not blocks.
    assert dense and all("norm" in n for n in dense), sorted(dense)
    assert len(types) - len(dense) >= CONFIG.num_layers * 7 * tp
    # Decode's products call the hand-written CPU dispatches of every layout in the file, and
    # its attention the decode-attention one. (Q4_K's and Q6_K's need AVX512-VNNI: on a CPU
    # without it those products keep the torch form.)
    layouts = {"q8_0": ["q8_0"], "q4_k_m": ["q4_k", "q6_k"] if INTEGER_DOT else []}[kind]
    assert manifest.module["cpu_kernels"] == ["decode_attention", *layouts]
    # The archives hold the file's blocks (replicated tables once per device that holds them).
    stored = sum(f["size"] for f in manifest.parameters["files"].values())
    model = load_model(path, tp=tp, pp=pp)
    assert stored <= 1.05 * model.source.theta.nbytes() * tp
    compiled = CompiledModel(out)
    got, _ = compiled.prefill(TOKENS[:1])
    want = model.prefill(TOKENS[:1])
    # float32 activations both ways; only the summation order differs.
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-4, f"max |error| / max |logit| = {err:.3g}"
    ids, steps = compiled.generate(TOKENS[:1], 4)
    assert torch.equal(ids, model.generate(TOKENS[:1], 4))
    # Decode's logits against the eager model's for the same tokens (one prefill over them all).
    # Q8_0's kernel takes float32 x: only the summation order differs. The Q4_K and Q6_K kernels
    # take x rounded to 16 bits per 32 values (export/kernels/int16_x): 1e-4 here (tp1), where
    # running this model with bfloat16 activations moves the same logits by 6-7e-2.
    s = TOKENS.shape[1]
    want = model.prefill(torch.cat([TOKENS[:1], ids[:, :-1]], 1))[:, s - 1 :]
    err = ((steps - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    assert err <= {"q8_0": 1e-4, "q4_k_m": 5e-3}[kind], f"decode: max |error| / max |logit| = {err:.3g}"
    # Those dispatches make the program CPU-only.
    assert kernels_in((out / "model.mlir").read_text()) == manifest.module["cpu_kernels"]
    if manifest.module["cpu_kernels"]:  # always, with the attention dispatch
        with pytest.raises(ArtifactError, match="hand-written CPU dispatches .*export it again with --target cuda"):
            compile_artifact(out, target="cuda")
        with pytest.raises(ArtifactError, match="exported for this host's CPU.*--target-arch x86-64-v3"):
            compile_artifact(out, target="cpu", target_arch="x86-64-v3")
    if kind == "q8_0":
        # Nor at load: IREE would hoist each dequantization into a float32 global computed at
        # initialisation; the compiled flow program must hoist no float tensor at all.
        import iree.compiler as ic

        flow = ic.compile_str((out / "model.mlir").read_text(), extra_args=[*manifest.compile["flags"], "--compile-to=flow"])
        flow = flow.decode() if isinstance(flow, bytes) else flow
        hoisted = re.findall(r"util\.global private (?:mutable )?@__hoisted\S* [^:]*: tensor<([^>]+)>", flow)
        assert not [t for t in hoisted if t.split("x")[-1].startswith(("f", "bf"))], hoisted


@pytest.mark.parametrize("target", ["cuda", "hip"])
def test_quantized_model_compiles_for_gpu_targets(q4_k_m_file, tmp_path, target):
    # No GPU here: the dequantize-in-the-product program compiles for both GPU targets.
    manifest = export_artifact(load_model(q4_k_m_file, tp=2, deferred=True), tmp_path / "art", source=str(q4_k_m_file), max_seq_len=16, target=target, functions=("prefill", "decode"))
    assert manifest.compile["driver"] == target and manifest.module["vmfb_size"] > 1000
    assert manifest.module["cpu_kernels"] == []  # GPU programs keep the torch form of the products
