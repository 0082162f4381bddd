"""The plain float16 weights' decode kernel (export/kernels/f16 in the frame of
product_dispatch), compiled, against float64 products: x of 1, 3 and 8 rows in float32,
bfloat16 and float16, times N = 71 weight rows (a workgroup of 64 and an odd remainder) of K =
4608 (one float32 row of x is 18 KiB, past X_CHUNK_BYTES: one row takes the rows-at-once path),
the weight's values of both signs, zeros and float16 subnormals among them.

The kernel multiplies the weight's values as stored with x widened to float32 and sums in
float32, so the only error is float32 summation (1e-5 of the largest value) and, for a half
result, its rounding (2^-8 of each value for bfloat16, 2^-11 for float16)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharktank.export import compile_mlir, export_function
from sharktank.export.kernels import KERNELS, block_product, isa, kernel_of, kernels_in
from sharktank.export.kernels.block_kernel import X_CHUNK_BYTES
from sharktank.export.kernels.custom_op import PRODUCTS
from sharktank.runtime import Session

N, K = 71, 4608
ROWS = (1, 3, 8)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = [(m, dtype) for m in ROWS for dtype in DTYPES]
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _weight() -> torch.Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(7)) * 0.05
    w[0] = 0.0
    w[1, :128] = torch.linspace(-5e-5, 5e-5, 128)  # float16 subnormals (below 6.1e-5)
    return w.half()


W = _weight()
XS = {m: torch.randn(m, K, generator=torch.Generator().manual_seed(m)) for m in ROWS}


@pytest.fixture(scope="module")
def compiled():
    def products(w, *xs):
        through = tuple(block_product(x.to(dtype), w).float() for x, (m, dtype) in zip((xs[ROWS.index(m)] for m, _ in CASES), CASES))
        # block_product hands the kernel float32 x; it also takes half x directly (widened per load).
        direct = tuple(PRODUCTS["F16"](xs[1].to(dtype), w, "f32") for dtype in (torch.bfloat16, torch.float16))
        return through + direct

    args = (W, *XS.values())
    mlir = str(export_function(products, args).mlir_module)
    session = Session(compile_mlir(mlir, 1), 1)
    results = session.call("main", [a.numpy() for a in args], [0] * len(args))
    keys = CASES + [(3, torch.bfloat16, "direct"), (3, torch.float16, "direct")]
    return mlir, {case: torch.from_numpy(np.asarray(r)) for case, r in zip(keys, results, strict=True)}


def test_the_weight_is_the_operand_and_one_row_goes_with_several_weight_rows():
    kernel, operand = kernel_of(W)
    assert kernel is KERNELS["F16"] and operand is W
    assert K * 4 > X_CHUNK_BYTES and kernel.rows_together(1, K, "f32") == kernel.rows_at_once > 1
    assert kernel_of(W.float()) is None and kernel_of(W[:, :100]) is None  # float32; K not a multiple of 32


def test_every_case_calls_the_f16_kernel(compiled):
    mlir, _ = compiled
    assert kernels_in(mlir) == ["f16"]
    for m, dtype in CASES:
        out = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
        assert f"@{KERNELS['F16'].function_name(m, N, K, 'f32', out)}(" in mlir


@pytest.mark.parametrize("m, dtype", CASES, ids=[f"m{m}-{str(d).split('.')[-1]}" for m, d in CASES])
def test_compiled_f16_products_match_float64(compiled, m, dtype):
    _, results = compiled
    got = results[(m, dtype)].double()
    want = XS[m].to(dtype).double() @ W.double().T
    assert got.shape == (m, N)
    scale = want.abs().max()
    err = (got - want).abs()
    bound = 1e-5 * scale + ROUNDING[dtype] * want.abs()
    assert bool((err <= bound).all()), f"max |error| / max |y| = {(err.max() / scale).item():.3g}"
    assert bool((got[:, 0] == 0).all()), "a zero weight row gives exactly 0"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_x_taken_directly_matches_float64(compiled, dtype):
    mlir, results = compiled
    elem = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    assert f"@{KERNELS['F16'].function_name(3, N, K, elem, 'f32')}(" in mlir
    want = XS[3].to(dtype).double() @ W.double().T
    err = (results[(3, dtype, "direct")].double() - want).abs().max() / want.abs().max()
    assert err.item() <= 1e-5, f"max |error| / max |y| = {err.item():.3g}"


def test_eager_form_is_the_float32_product():
    got = block_product(XS[3], W)  # not traced: the custom op's eager form
    want = XS[3].double() @ W.double().T
    assert got.dtype == torch.float32 and ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-6


def test_bfloat16_weights_on_a_cpu_without_avx512_bf16_take_the_same_kernel():
    """Where the CPU has no bfloat16 arithmetic (isa: a bf16_dot of "avx2"), a plain bfloat16
    weight takes this kernel too (export/kernels/bf16): its values widened exactly, so the
    error is float32 summation (and a bfloat16 result's rounding). The decode kernel needs no
    instruction of that form, so it runs on any host."""
    wb = W.bfloat16()
    with isa.using(isa.Isa(int8_dot=isa.HOST.int8_dot, bf16_dot="avx2")):
        assert kernel_of(wb)[0] is KERNELS["BF16"]

        def products(w, x1, x8):
            return block_product(x1, w), block_product(x8.bfloat16(), w).float()

        mlir = str(export_function(products, (wb, XS[1], XS[8])).mlir_module)
    with isa.using(isa.Isa(int8_dot=isa.HOST.int8_dot, bf16_dot="avx512_bf16")):
        assert kernel_of(wb) is None  # IREE's own bfloat16 products
    assert kernels_in(mlir) == ["bf16"]
    session = Session(compile_mlir(mlir, 1), 1)
    from iree.runtime import HalElementType

    placed = [session.place(wb.view(torch.uint16).numpy(), 0, element_type=HalElementType.BFLOAT_16)]
    placed += [session.place(XS[m].numpy(), 0) for m in (1, 8)]
    outs = [torch.from_numpy(np.asarray(o.to_host())).double() for o in session.invoke("main", placed)]
    for got, m, rounding in ((outs[0], 1, 0.0), (outs[1], 8, 2.0**-8)):
        x = XS[m] if m == 1 else XS[m].bfloat16()
        want = x.double() @ wb.double().T
        err = (got - want).abs()
        assert bool((err <= 1e-5 * want.abs().max() + rounding * want.abs()).all()), f"M={m}: max |error| / max |y| = {(err.max() / want.abs().max()).item():.3g}"
