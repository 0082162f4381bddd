"""The prompt-product kernels (export/kernels/prefill: tiles dequantized to bfloat16, ``vdpbf16ps``
or its AVX2 form, whichever this host has) of every layout that has one, compiled once with a dynamic number of rows and run at 1, 7, 64
and 300 rows (a ragged tail of 8, none, a part of a group), against float64 products:

- with the operands the kernel multiplies (x and the dequantized weight rounded to bfloat16),
  which it must match up to float32 summation (1e-5 of the largest value);
- with the true operands, within the bound the module states for its numerics (4e-3 of the
  largest value for the operands, as bfloat16 keeps 8 significant bits, and as much again for
  the bfloat16 result: 8e-3);
- with the custom op's eager form (the torch the trace replaces);
- at one row (no tile: the weights' values in float32), each value with the true operands'
  up to its rounding to the bfloat16 result (and float32 summation: 1e-5 of the largest value).

Weights: N = 96 rows (three workgroups), K = 1280 (five K-quant super-blocks; several chunks of
K), float16 scales positive, negative and zero as real files have them; and a plain float16
weight (``F16``: an F16 GGUF's), its values of both signs, zeros and values below float16's
normal range among them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantized_models import signed_blocks
from sharktank.export import compile_mlir, export_function
from sharktank.export.compile import QUANTIZED_FLAGS
from sharktank.export.kernels import BF16_DOT, KERNELS, BlockProducts, block_product, CpuKernels, kernel_of, kernels_in, prefill_product, prefill_weights
from sharktank.export.kernels import isa, prefill
from sharktank.export.kernels.custom_op import PREFILLS
from sharktank.export.kernels.registry import PREFILLS as PREFILL_WEIGHTS
from sharktank.types import QuantizedTensor
from sharktank.runtime import Session

N, K = 96, 1280
ROWS = (1, 7, 64, 300)
PREFILL_LAYOUTS = sorted(PREFILLS)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())


def test_bf16_dot_is_the_cpu_s_avx512_bf16_and_without_it_prompts_keep_the_dense_product():
    """The switch against an independent read of the CPU's flags; without it, no prefill
    dispatch (the caller takes the dense product)."""
    flags = _cpu_flags()
    assert BF16_DOT == ("avx512_bf16" in flags or {"avx2", "fma"} <= flags)
    assert isa.HOST.bf16_dot == ("avx512_bf16" if "avx512_bf16" in flags else "avx2" if {"avx2", "fma"} <= flags else None)
    with isa.using(isa.Isa(int8_dot=isa.HOST.int8_dot, bf16_dot=None)):
        assert prefill_product(torch.randn(9, K).bfloat16(), WEIGHTS["Q8_0"]) is None


# The compiled cases need a bf16_dot form: AVX512-BF16, or AVX2 with FMA (any x86 CPU of the
# last decade); without one test_bf16_dot_... checks that prompts keep the dense product.
needs_bf16 = pytest.mark.skipif(not BF16_DOT, reason="neither AVX512-BF16 nor AVX2+FMA: test_bf16_dot_... checks that prompts then keep the dense product")

def _f16_weight() -> torch.Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(16)) * 0.05
    w[0, :64] = 0.0
    w[1, :64] = torch.linspace(-3e-5, 3e-5, 64)  # float16 subnormals (below 6.1e-5)
    return w.half()


PLAIN = {"F16": _f16_weight, "BF16": lambda: _f16_weight().bfloat16()}
WEIGHTS = {layout: PLAIN[layout]() if layout in PLAIN else signed_blocks(layout, N, K, i, 1e-2) for i, layout in enumerate(PREFILL_LAYOUTS)}
# What this host's prompts take a kernel for: bfloat16 weights only without AVX512-BF16 (kernels/bf16).
HOST_LAYOUTS = [layout for layout in PREFILL_LAYOUTS if prefill_weights(WEIGHTS[layout]) is not None]


def _arg(w) -> torch.Tensor:
    """What the traced function takes for a weight: a quantized one's blocks, a plain one itself."""
    return w.blocks if isinstance(w, QuantizedTensor) else w


def _with(w, arg):
    return w.with_blocks(arg) if isinstance(w, QuantizedTensor) else arg


def _dense(w) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantizedTensor) else w.float()


def test_every_kernel_layout_and_float16_have_a_prefill_kernel():
    assert "F16" in KERNELS and "BF16" in KERNELS
    # F32 is a decode kernel for stacked float32 experts only: a prompt's float32 products
    # (grouped experts included) are IREE's packed ones, and no dense product takes it.
    assert PREFILL_LAYOUTS == sorted(set(KERNELS) - {"F32"}), "a layout with a decode kernel and no prefill kernel keeps prompts on the dense product"
    assert kernel_of(torch.zeros(64, 64)) is None and kernel_of(torch.zeros(2, 64, 64), stacked=True)[0] is KERNELS["F32"]


def test_float16_weights_are_passed_as_they_are():
    """The F16 dispatch takes the weight itself (a view of other bytes would be a copy in
    IREE), and its eager form gives the weight back exactly; other plain weights have none."""
    w = WEIGHTS["F16"]
    weights, operand = prefill_weights(w)
    assert weights is PREFILL_WEIGHTS["F16"] and operand is w
    assert torch.equal(weights.dense(operand), w.float())
    assert prefill_weights(torch.randn(N, K)) is None
    assert prefill_weights(torch.randn(N, 1000).half()) is None  # K not a multiple of 32


def test_bfloat16_weights_take_the_kernels_only_without_avx512_bf16():
    w = WEIGHTS["BF16"]
    with isa.using(isa.Isa(int8_dot=isa.HOST.int8_dot, bf16_dot="avx512_bf16")):
        assert prefill_weights(w) is None and block_product(torch.randn(1, K), w) is None  # IREE's own bfloat16 products
    with isa.using(isa.Isa(int8_dot=isa.HOST.int8_dot, bf16_dot="avx2")):
        weights, operand = prefill_weights(w)
        assert weights is PREFILL_WEIGHTS["BF16"] and operand is w and torch.equal(weights.dense(operand), w.float())
        assert block_product(torch.randn(1, K), w) is not None
    assert HOST_LAYOUTS == [layout for layout in PREFILL_LAYOUTS if layout != "BF16" or isa.HOST.bf16_dot != "avx512_bf16"]


@pytest.fixture(scope="module")
def compiled():
    def products(x, *blocks):
        return tuple(prefill_product(x, _with(WEIGHTS[layout], b)).float() for layout, b in zip(HOST_LAYOUTS, blocks))

    x = torch.randn(64, K).bfloat16()
    blocks = [_arg(WEIGHTS[layout]) for layout in HOST_LAYOUTS]
    rows = torch.export.Dim("rows", min=1, max=512)
    program = export_function(products, (x, *blocks), dynamic_shapes=({0: rows}, *[None] * len(blocks)))
    mlir = str(program.mlir_module)
    session = Session(compile_mlir(mlir, 1, extra=QUANTIZED_FLAGS), 1)
    placed = [_place(session, b) for b in blocks]
    return mlir, session, placed


def _place(session, t: torch.Tensor):
    """``t`` on device 0 (numpy has no bfloat16: its bits, typed)."""
    if t.dtype != torch.bfloat16:
        return session.place(t.numpy(), 0)
    from iree.runtime import HalElementType

    return session.place(t.view(torch.uint16).numpy(), 0, element_type=HalElementType.BFLOAT_16)


@needs_bf16
def test_the_program_calls_every_prefill_dispatch(compiled):
    mlir, _, _ = compiled
    for layout in HOST_LAYOUTS:
        assert f"@{prefill.function_prefix(PREFILL_WEIGHTS[layout])}{N}x{K}" in mlir
    assert kernels_in(mlir) == sorted(f"{layout.lower()}_prefill" for layout in HOST_LAYOUTS)


@needs_bf16
@pytest.mark.parametrize("m", ROWS)
def test_compiled_prefill_products_match_float64(compiled, m):
    _, session, placed = compiled
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16().float()
    outs = session.invoke("main", [_place(session, x.bfloat16()), *placed])
    for layout, out in zip(HOST_LAYOUTS, outs):
        got = torch.from_numpy(np.asarray(out.to_host())).double()
        assert got.shape == (m, N)
        dense = _dense(WEIGHTS[layout]).double()
        rounded = x.double() @ dense.bfloat16().double().T
        exact = x.double() @ dense.T
        scale = exact.abs().max()
        assert ((got - rounded).abs().max() / scale).item() <= 4e-3, f"{layout} M={m}: not the bfloat16 operands' product"
        assert ((got - exact).abs().max() / scale).item() <= 8e-3, f"{layout} M={m}: further from the true product than bfloat16 rounding"
        if m == 1:  # each sum of exact products, rounded once to the result's bfloat16 (half an ulp: 2^-8 of it)
            assert ((got - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * scale).all(), f"{layout} M=1: not the float32 values' product"
        eager = PREFILLS[layout](x.bfloat16(), prefill_weights(WEIGHTS[layout])[1]).double()
        assert ((got - eager).abs().max() / scale).item() <= 4e-3, f"{layout} M={m}: compiled and eager differ"


@needs_bf16
def test_prefill_refusals_keep_the_dense_product():
    kernel = KERNELS["Q4_K"].prefill
    assert "N a multiple of 32, found N=80" in prefill.refusal(kernel, 80, 1280)
    assert "K a multiple of 256, found K=1000" in prefill.refusal(kernel, 96, 1000)
    assert prefill.refusal(kernel, 96, 1280) is None
    w = signed_blocks("Q4_K", 80, K, 0, 1e-2)
    assert prefill_product(torch.randn(9, K), w) is None  # no dispatch: the caller takes the dense product
    with pytest.raises(ValueError, match="N a multiple of 32"):
        prefill.module_asm(kernel, 80, 1280)


@needs_bf16
def test_decode_rows_take_the_decode_kernels_and_more_the_prefill_ones():
    """BlockProducts (what export traces with) routes a static 8 rows to the decode kernels and
    9 or a symbolic number to the prefill dispatch."""
    w = WEIGHTS["Q8_0"]

    def fn(x8, x9):
        products = BlockProducts()
        return products(x8, w), products(x9, w)

    mlir = str(export_function(fn, (torch.randn(8, K).bfloat16(), torch.randn(9, K).bfloat16())).mlir_module)
    assert "@sharktank_q8_0_product_8x96x1280" in mlir and "@sharktank_q8_0_prefill_96x1280" in mlir
    assert "sharktank_q8_0_product_9x" not in mlir


@needs_bf16
def test_float16_weights_take_the_decode_kernel_for_8_rows_and_the_prefill_dispatch_for_more():
    """A plain float16 weight through ops.linear under BlockProducts: a static 8 rows take the
    F16 decode kernel, 9 rows the F16 prefill dispatch, so that no dense product reads the
    weight; --exact-prompts keeps a float16 prompt's dense product."""
    from sharktank import ops

    w = WEIGHTS["F16"]

    def fn(x8, x9, kernels=BlockProducts()):
        with ops.block_kernels(kernels):
            return ops.linear(x8, w), ops.linear(x9, w)

    args = (torch.randn(8, K).half(), torch.randn(9, K).half())
    mlir = str(export_function(fn, args, strict=False).mlir_module)
    assert mlir.count(f"call @sharktank_f16_prefill_{N}x{K}(") == 1, "one call, for the 9 rows"
    assert mlir.count(f"call @sharktank_f16_product_8x{N}x{K}_f32_to_f16(") == 1, "one call, for the 8 rows"
    assert kernels_in(mlir) == ["f16", "f16_prefill"]
    exact = str(export_function(lambda a, b: fn(a, b, BlockProducts(CpuKernels(exact_prompts=True))), args, strict=False).mlir_module)
    assert kernels_in(exact) == ["f16"]


@needs_bf16
def test_exact_prompts_keep_the_dense_product_for_float32_and_float16_x():
    """--exact-prompts: a float32 or float16 prompt's product is the caller's dense one (None
    here); bfloat16 x takes the dispatch either way (the dense product is bfloat16 too)."""
    w, exact = WEIGHTS["Q8_0"], BlockProducts(CpuKernels(exact_prompts=True))
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(9, K).to(dtype)
        assert exact(x, w) is None
        got = BlockProducts()(x, w)
        assert got is not None and got.dtype == dtype
    assert exact(torch.randn(9, K).bfloat16(), w) is not None


@needs_bf16
def test_a_quantized_model_s_prompt_through_the_dispatches_at_tp2(tmp_path):
    """The default export of a float32 Q4_K_M-style model (Q4_K and Q6_K weights) at tp 2: its
    prompt's products call the prefill dispatches, and its prompt logits stay closer to the
    eager float32 model's than the same model run with bfloat16 activations (which rounds
    every activation, not only the products' operands), and within 2e-2 of the largest logit
    (measured: 1.5e-2 on this random 2-layer model, 2e-3 to 8e-3 on others: the rounding of
    x and of the weight tile to bfloat16, 2^-9 each)."""
    from quantized_models import CONFIG, TOKENS, quantized_theta
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model, save_gguf
    from sharktank.runtime import CompiledModel

    path = tmp_path / "q4_k_m.gguf"
    save_gguf(path, CONFIG, quantized_theta("q4_k_m"))
    out = tmp_path / "art"
    manifest = export_artifact(load_model(path, tp=2, deferred=True), out, source=str(path), max_seq_len=32, functions=("prefill", "decode"))
    assert {"q4_k_prefill", "q6_k_prefill"} <= set(manifest.module["cpu_kernels"])
    prompt = TOKENS[:1]  # 12 tokens: more rows than a decode kernel takes
    want = load_model(path, tp=2).prefill(prompt)
    got, _ = CompiledModel(out).prefill(prompt)
    scale = want.abs().max()
    err = ((got - want).abs().max() / scale).item()
    half = load_model(path, tp=2, dtype=torch.bfloat16).prefill(prompt).float()
    half_err = ((half - want).abs().max() / scale).item()
    assert err <= 2e-2, f"prompt logits: max |error| / max |logit| = {err:.3g}"
    assert err < half_err, f"the dispatches ({err:.3g}) moved the logits further than bfloat16 activations ({half_err:.3g})"
