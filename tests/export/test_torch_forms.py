"""The torch forms of the quantized products, compiled: what GPU exports and CPUs other than this
host run (``kernels.kernels_for``: the kernels are written for this host, any other target or
``--target-arch`` keeps the torch form), and what no other compiled test runs.

A two-layer Llama whose 15 products take every block layout that loads (``types.LAYOUTS``), one
layout per weight, so that one export and one compile cover them all. It is exported for ``cpu``
at ``--target-arch x86-64-v3`` (AVX2: another target than this host, so no kernel, and any
x86 host of these tests runs it), and its compiled prefill and decode logits are checked against the eager
model's. The blocks are random bytes whose float16 scales (and mins) are positive, negative and
zero, as real files have them.

And the host-feature switch (``kernels.isa.HOST``, ``kernels.INTEGER_DOT``) against this file's own read of
``/proc/cpuinfo``, so that the kernel tests' choice of cases does not just follow the code."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from quantized_models import CONFIG, TOKENS
from sharktank.export import kernels
from sharktank.export.artifact import export_artifact
from sharktank.export.kernels import isa
from sharktank.export.kernels.syntax import int8_dot
from sharktank.models import load_model, save_gguf
from sharktank.models.llama.presets import random_theta
from sharktank.runtime import CompiledModel
from sharktank.types import LAYOUTS, QuantizedTensor
from sharktank.weights import Theta

ARCH = "x86-64-v3"  # not this host's name for itself: the export keeps every torch form
# Where each layout's blocks hold float16 numbers: d (and the min's scale, m or dmin).
SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "Q2_K": (80, 82),
          "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
EMBEDDING = "Q8_0"  # a lookup, not a product (as in the SmolLM2 file)


def _set_scales(raw: np.ndarray, layout: str, values: np.ndarray) -> None:
    for at in SCALES[layout]:
        raw[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _blocks(layout: str, rows: int, cols: int, std: float, seed: int) -> QuantizedTensor:
    """Random valid blocks: any bytes, but finite float16 scales of either sign, one in ten 0,
    drawn at unit size and then scaled so that the weight's values have about ``std``."""
    lay, rng = LAYOUTS[layout], np.random.default_rng(seed)
    n = rows * cols // lay.block_size
    raw = rng.integers(0, 256, size=(n, lay.block_bytes), dtype=np.uint8)
    unit = rng.choice([-1.0, 0.0, 1.0], n, p=[0.45, 0.1, 0.45]) * rng.uniform(0.5, 1.0, n)
    _set_scales(raw, layout, unit)
    drawn = gguf.quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType[layout]).std()
    _set_scales(raw, layout, unit * (std / drawn))
    return QuantizedTensor(layout, (rows, cols), torch.from_numpy(raw))


def _theta() -> tuple[Theta, dict[str, str]]:
    """The model's weights and the layout of each product's weight (every layout in turn)."""
    missing = sorted(set(LAYOUTS) - set(SCALES))
    assert not missing, f"scale offsets expected for every layout, missing for {missing}"
    theta, layouts = dict(random_theta(CONFIG, seed=5)), {}
    order = list(LAYOUTS)
    for i, (name, t) in enumerate(theta.items()):
        if t.ndim != 2:
            continue  # norms stay float32, as in llama.cpp's files
        layout = EMBEDDING if "embed" in name else order[len(layouts) % len(order)]
        theta[name] = _blocks(layout, *t.shape, std=t.std().item(), seed=i)
        if "embed" not in name:
            layouts[name] = layout
    return Theta(theta), layouts


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the file, the artifact directory, its manifest, product weight -> layout)."""
    flags = _processor_flags()
    if not flags or not all({"avx2", "fma", "bmi2"} <= f for f in flags):
        pytest.skip(f"code for {ARCH} needs AVX2, FMA and BMI2, which this CPU's /proc/cpuinfo does not list")
    theta, layouts = _theta()
    work = tmp_path_factory.mktemp("torch_forms")
    path, out = work / "mixed.gguf", work / "art"
    save_gguf(path, CONFIG, theta)
    manifest = export_artifact(load_model(path, tp=1, deferred=True), out, source=str(path), max_seq_len=32, target_arch=ARCH,
                               functions=("prefill", "decode"))
    return path, out, manifest, layouts


def test_weights_take_every_layout_with_negative_and_zero_scales():
    theta, layouts = _theta()
    assert sorted(set(layouts.values())) == sorted(LAYOUTS), f"expected every layout among {len(layouts)} products, found {sorted(set(layouts.values()))}"
    for name, layout in layouts.items():
        blocks = theta[name].blocks.reshape(-1, LAYOUTS[layout].block_bytes).numpy()
        d = blocks[:, SCALES[layout][0] : SCALES[layout][0] + 2].copy().view(np.float16)
        assert (d < 0).any() and (d == 0).any() and (d > 0).any(), f"{name} ({layout}): scales of each sign and 0 expected"


def test_export_for_another_arch_calls_no_product_kernel(exported):
    _, out, manifest, _ = exported
    assert not kernels.kernels_for("cpu", ARCH)
    assert manifest.module["cpu_kernels"] == [], f"no hand-written dispatch expected at --target-arch {ARCH}, found {manifest.module['cpu_kernels']}"
    mlir = (out / "model.mlir").read_text()
    called = [k.function_prefix for k in kernels.KERNELS.values() if f"@{k.function_prefix}" in mlir]
    assert not called, f"no product kernel expected in the MLIR, found {called}"


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst position's max |error| / max |logit|."""
    return ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()


def test_compiled_torch_forms_match_eager(exported):
    path, out, _, layouts = exported
    model, compiled = load_model(path, tp=1), CompiledModel(out)
    loaded = {name: t.layout.name for name, t in model.source.theta.items() if isinstance(t, QuantizedTensor) and "embed" not in name}
    assert sorted(set(loaded.values())) == sorted(LAYOUTS), f"expected every layout loaded, found {sorted(set(loaded.values()))}"
    prompt = TOKENS[:1]
    got, _ = compiled.prefill(prompt)
    want = model.prefill(prompt)
    # float32 activations both ways, the same dequantization: only the summation order differs
    # (about 1e-6 here; decode's IQ4_NL product, miscompiled for AVX2 before, gave errors of 1).
    err = _relative_error(got, want)
    assert err <= 1e-5, f"prefill: max |error| / max |logit| = {err:.3g}, expected <= 1e-5"
    ids, steps = compiled.generate(prompt, 4)
    want_ids = model.generate(prompt, 4)
    assert torch.equal(ids, want_ids), f"tokens: expected {want_ids.tolist()}, found {ids.tolist()}"
    # Decode's logits against one eager prefill over the same tokens.
    s = prompt.shape[1]
    want = model.prefill(torch.cat([prompt, ids[:, :-1]], 1))[:, s - 1 :]
    err = _relative_error(steps, want)
    assert err <= 1e-5, f"decode: max |error| / max |logit| = {err:.3g}, expected <= 1e-5"


def _processor_flags() -> list[set[str]]:
    """Each processor's feature flags as /proc/cpuinfo lists them (x86: ``flags : ...``); none
    where the file is missing or lists none (other architectures say ``Features``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return [set(line.partition(":")[2].split()) for line in text.splitlines() if re.match(r"flags\s*:", line)]


def test_integer_dot_is_what_cpuinfo_says():
    # The int16-x kernels' dot product is the 512-bit vpdpbusd, which AVX512-VNNI gives (AVX-VNNI
    # has only the 128- and 256-bit forms), or else AVX2's vpmaddubsw + vpmaddwd: so those
    # flags, on every processor, are the switch.
    with isa.using(isa.Isa(int8_dot="avx512_vnni")):
        assert "avx512.vpdpbusd.512" in int8_dot("%acc", "%u", "%s")
    flags = _processor_flags()
    has = {flag: sum(flag in f for f in flags) for flag in ("avx512_vnni", "avx_vnni", "avx2")}
    want = None
    if flags and has["avx512_vnni"] == len(flags):
        want = "avx512_vnni"
    elif flags and has["avx2"] == len(flags):
        want = "avx2"
    assert kernels.isa.HOST.int8_dot == want and kernels.INTEGER_DOT == (want is not None), (
        f"the host's int8 dot is {kernels.isa.HOST.int8_dot}, expected {want}: of {len(flags)} processors in /proc/cpuinfo, "
        f"{has['avx512_vnni']} list avx512_vnni, {has['avx_vnni']} avx_vnni, {has['avx2']} avx2")