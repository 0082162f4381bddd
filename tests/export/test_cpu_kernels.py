"""The hand-written CPU block-product kernels (export/kernels: every layout of its registry),
eagerly and compiled, against float64 products with the dequantized weight (and, for the
kernels that take x as 16-bit integers, with the x they multiply by: int16_x.dequantized).

One exported program holds every case (one compile): for each layout, x of 1, 3 and 8 rows,
in float32 and bfloat16, times N = 71 weight rows (a full workgroup of 64 and an odd
remainder of 7), of weights whose float16 scales (and offsets) are positive, negative and 0.
One float32 row of x (K = 4608: 18 KiB) is more than ``block_kernel.X_CHUNK_BYTES``, so with one
row the weight rows go ``rows_at_once`` at a time, the last tile having fewer rows than one
part of it; three rows of x go in passes of 5, 5, 5 and 3 super-blocks."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from quantized_models import SCALE_OFFSETS, signed_blocks

from sharktank.export import compile_mlir, export_function
from sharktank.export.compile import QUANTIZED_FLAGS
from sharktank.export.kernels import INTEGER_DOT, KERNELS, BlockProducts, block_product, int16_x, kernels_in
from sharktank.export.kernels import LAYOUTS as ALL_LAYOUTS
from sharktank.export.kernels import isa
from sharktank.export.kernels.block_kernel import BATCH_TILES, GROUP, X_CHUNK_BYTES
from sharktank.export.kernels.custom_op import PRODUCTS, ROUNDINGS
from sharktank.export.kernels.product_dispatch import module_asm
from sharktank.runtime import Session
from sharktank.types import LAYOUTS, QuantizedTensor

N, K = 71, 4608  # K: 18 K-quant super-blocks, 144 blocks of 32
# The int16-x kernels (Q4_K, Q5_K, Q6_K) need AVX512-VNNI; on a host without it their layouts keep
# the torch form (test_int16_x_kernels_need_the_integer_dot) and are not among the cases.
INT16_X = [layout for layout in ALL_LAYOUTS if KERNELS[layout].int16_x]
KERNEL_LAYOUTS = [layout for layout in ALL_LAYOUTS if INTEGER_DOT or layout not in INT16_X]
ROWS = (1, 3, 8)
CASES = [(layout, m, dtype) for layout in KERNEL_LAYOUTS for m in ROWS for dtype in (torch.float32, torch.bfloat16)]

WEIGHTS = {layout: signed_blocks(layout, N, K, i, 1e-3) for i, layout in enumerate(ALL_LAYOUTS)}
XS = {m: torch.randn(m, K, generator=torch.Generator().manual_seed(m)) for m in ROWS}


def _products(*args):
    """Every case's kernel product (as float32); args: x per row count, then each layout's blocks."""
    xs = dict(zip(XS, args[: len(XS)]))
    blocks = dict(zip(KERNEL_LAYOUTS, args[len(XS) :]))
    through = tuple(block_product(xs[m].to(dtype), WEIGHTS[layout].with_blocks(blocks[layout])).float() for layout, m, dtype in CASES)
    # block_product hands the float kernels float32 x; they also take bfloat16 x directly.
    direct = tuple(PRODUCTS[layout](xs[3].bfloat16(), blocks[layout].view(torch.int8), "bf16").float() for layout in FLOAT_X)
    # The int16 kernels' x as its dispatch rounds it (planes, scales, sums), of a row with
    # a zero group, a large value and a tie (x * LIMIT / max|x| = 0.5 exactly).
    rounded = tuple(r for layout, m, dtype in ROUNDED for r in ROUNDINGS[layout](_rounding_x(xs[m]).to(dtype)))
    return through + direct + rounded


def _rounding_x(x: torch.Tensor) -> torch.Tensor:
    x = torch.cat([x[:, :32] * 0, x[:, 32:]], 1)  # group 0: all zeros (scale 0)
    x[:, 40] = 1e4  # group 1: one large value, the others much coarser
    x[:, 64], x[:, 65] = int16_x.LIMIT, 0.5  # group 2: max|x| = LIMIT, so 0.5 rounds to 0 (even)
    return x


FLOAT_X = [layout for layout in KERNEL_LAYOUTS if "bf16" in KERNELS[layout].elements]
ROUNDED = [(layout, m, dtype) for layout in INT16_X if layout in KERNEL_LAYOUTS for m, dtype in ((1, torch.float32), (3, torch.bfloat16))]


def _reference(layout: str, m: int, dtype: torch.dtype) -> torch.Tensor:
    x = XS[m].to(dtype)
    if layout in INT16_X:  # the x these kernels multiply by
        order = KERNELS[layout].int16.order
        unit = KERNELS[layout].int16.unit
        x = int16_x.dequantized(*int16_x.quantize(x, order, unit=unit)[:2], order, unit)
    return x.double() @ _gguf_values(WEIGHTS[layout]).T


def _gguf_values(w: QuantizedTensor) -> torch.Tensor:
    """The weight as the gguf package expands it (not our code), in float64."""
    blocks = w.blocks.reshape(w.shape[0], -1).numpy()
    return torch.from_numpy(gguf.quants.dequantize(blocks, GGMLQuantizationType[w.layout.name]).astype(np.float64)).reshape(w.shape)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: only the summation order differs. bfloat16: x is rounded to bfloat16 in both,
    # accumulation is float32, and the result is rounded to bfloat16 (8 significant bits):
    # at most 2^-8 of each value, plus the float32 error.
    scale = want.abs().max()
    bound = 1e-5 * scale + (2.0**-8 * want.abs() if dtype == torch.bfloat16 else 0)
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max |error| / max |y| = {(err.max() / scale).item():.3g}"


@pytest.fixture(scope="module")
def compiled():
    args = (*XS.values(), *(WEIGHTS[layout].blocks for layout in KERNEL_LAYOUTS))
    mlir = str(export_function(_products, args).mlir_module)
    session = Session(compile_mlir(mlir, 1, extra=QUANTIZED_FLAGS), 1)
    results = session.call("main", [a.numpy() for a in args], [0] * len(args))
    keys = CASES + [(layout, 3, "bf16 kernel") for layout in FLOAT_X] + [(*case, part) for case in ROUNDED for part in ("planes", "scales", "sums")]
    return mlir, dict(zip(keys, (torch.from_numpy(np.asarray(r)) for r in results), strict=True))


def test_weights_have_negative_and_zero_scales():
    for layout, w in WEIGHTS.items():
        d = w.blocks[..., SCALE_OFFSETS[layout][0] : SCALE_OFFSETS[layout][0] + 2].contiguous().view(torch.float16)
        assert bool((d < 0).any() and (d == 0).any() and (d > 0).any()), layout


def _block_loop_carries(mlir: str) -> int:
    """The values the innermost loop (over a row's blocks) carries: accumulators per row of x,
    per accumulator, per weight row going at once."""
    counts = [int(n) for n in re.findall(r"%r_\d+:(\d+) = scf\.for .* iter_args", mlir)]
    assert len(counts) == 1, counts
    return counts[0]


def test_one_row_of_x_goes_with_several_weight_rows_at_once():
    # The float-x cases above take the rows_at_once path with one row of x, not with three.
    assert K * 4 > X_CHUNK_BYTES
    for layout in FLOAT_X:
        kernel = KERNELS[layout]
        slots = len(kernel.accumulators)
        assert kernel.rows_at_once > 1 and kernel.rows_together(1, K, "f32") == kernel.rows_at_once
        assert _block_loop_carries(module_asm(kernel, 1, N, K, "f32")) == kernel.rows_at_once * slots
        with isa.using(isa.Isa(int8_dot="avx512_vnni")):  # several rows: one weight row at a time
            assert _block_loop_carries(module_asm(kernel, 3, N, K, "f32")) == 3 * slots


def _block_loops(mlir: str) -> list[tuple[int, list[str]]]:
    """Per loop over a row's blocks: how many values it carries and their types."""
    found = re.findall(r"%r_\d+:(\d+) = scf\.for .* iter_args\((.*)\) -> \((.*)\) \{", mlir)
    return [(int(n), [t.strip() for t in types.split(",")]) for n, _, types in found]


@pytest.mark.parametrize("layout", ["Q8_0", "F16", "BF16", "Q4_K"])
def test_several_rows_of_x_take_the_avx2_batch_tile_with_float_x(layout):
    # With AVX2's 16 registers, 8 rows of float x go 4 rows x 2 weight rows a loop over the
    # blocks, in accumulators of 8 lanes (BATCH_TILES), so that none spills; the int16-x
    # kernels keep all 8 rows in one loop. The numerics are the CASES' (rows 3 and 8).
    kernel, tile = KERNELS[layout], BATCH_TILES[32]
    elem = "i16" if kernel.int16_x else "f32"
    with isa.using(isa.Isa(int8_dot="avx2")):
        loops = _block_loops(module_asm(kernel, 8, N, K, elem))
    x_rows, weight_rows, lanes = (8, 1, 64) if kernel.int16_x else (tile.x_rows, tile.weight_rows, tile.lanes)
    assert len(loops) == 8 // x_rows
    for carried, types in loops:
        assert carried == x_rows * weight_rows * len(kernel.accumulators)
        assert set(types) == {f"vector<{min(width, lanes)}xf32>" for width in kernel.accumulators}


def test_every_kernel_layout_is_called_in_the_export(compiled):
    mlir, _ = compiled
    assert kernels_in(mlir) == sorted(name.lower() for name in KERNEL_LAYOUTS)
    # bfloat16 x: each kernel stores y as bfloat16 itself (x going in as float32 or int16).
    for layout in KERNEL_LAYOUTS:
        elem = "i16" if layout in INT16_X else "f32"
        assert f"@{KERNELS[layout].function_name(1, N, K, elem, 'bf16')}(" in mlir
        assert KERNELS[layout].function_name(1, N, K, elem, "bf16").endswith(f"_{elem}_to_bf16")


@pytest.mark.parametrize("layout, m, dtype", CASES, ids=[f"{lay}-m{m}-{str(d)[6:]}" for lay, m, d in CASES])
def test_kernel_matches_dequantized_product(compiled, layout, m, dtype):
    _, results = compiled
    want = _reference(layout, m, dtype)
    _check(results[(layout, m, dtype)], want, dtype)
    _check(block_product(XS[m].to(dtype), WEIGHTS[layout]).float(), want, dtype)  # eager: the torch form


@pytest.mark.parametrize("layout", FLOAT_X)
def test_kernel_with_bfloat16_x_matches_dequantized_product(compiled, layout):
    mlir, results = compiled
    assert f"sharktank_{layout.lower()}_product_3x{N}x{K}_bf16" in mlir
    _check(results[(layout, 3, "bf16 kernel")], _reference(layout, 3, torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("order", [tuple(range(8)), (0, 2, 1, 3, 4, 6, 5, 7), (7, 6, 5, 4, 3, 2, 1, 0)])
def test_int16_x_is_within_half_a_step_of_x_and_its_sums_are_of_its_values(order):
    assert INT16_X, "no kernel takes int16 x"
    x = torch.cat([XS[3], torch.zeros(1, K)])  # a row of zeros: scale 0, values 0
    x[0, 5] = 1e4  # a large value: its group's other values get coarser steps
    planes, scales, sums = int16_x.quantize(x, order)
    assert planes.dtype == torch.int8 and planes.shape == (4, 2 * K)
    high = planes.reshape(4, K // 256, 2, 256)[:, :, 0]
    assert int(high.abs().max()) == 127  # each group's largest value: +-LIMIT = 127 * 256 + 127
    x_hat = int16_x.dequantized(planes, scales, order)
    step = scales.repeat_interleave(GROUP, dim=1)
    # Half a step, plus float32's rounding of x * LIMIT / max|x| (v up to 32639: 2^-9 of a step).
    assert bool(((x_hat - x).abs() <= step * (0.5 + 2**-8)).all())
    assert torch.equal(x_hat[3], torch.zeros(K)) and torch.equal(sums[3], torch.zeros(K // GROUP))
    torch.testing.assert_close(sums, x_hat.reshape(4, -1, GROUP).sum(-1))
    # The kernels' planes: group j of each 256 values holds group order[j] of x.
    natural = int16_x.quantize(x, tuple(range(8)))[0].reshape(4, K // 256, 2, 8, 32)
    assert torch.equal(planes.reshape(4, K // 256, 2, 8, 32), natural[:, :, :, list(order)])
    # Relative to a product, rounding x to 16 bits is far below bfloat16's rounding of x.
    w = WEIGHTS["Q4_K"].dequantize().double()
    err = ((x_hat.double() - x.double())[:3] @ w.T).abs().max() / (x[:3].double() @ w.T).abs().max()
    bf16 = ((x.bfloat16().double() - x.double())[:3] @ w.T).abs().max() / (x[:3].double() @ w.T).abs().max()
    assert err < bf16 / 10, (err, bf16)


@pytest.mark.parametrize("layout, m, dtype", ROUNDED, ids=[f"{lay}-m{m}-{str(d)[6:]}" for lay, m, d in ROUNDED])
def test_int16_x_dispatch_rounds_x_as_the_torch_scheme(compiled, layout, m, dtype):
    mlir, results = compiled
    kernel = KERNELS[layout]
    x = _rounding_x(XS[m]).to(dtype)
    assert int16_x.function_name(m, K, str(dtype)[6:].replace("float32", "f32").replace("bfloat16", "bf16"), kernel.int16.order, kernel.sum_group, kernel.int16.unit) in mlir
    planes, scales, sums = int16_x.quantize(x, kernel.int16.order, kernel.sum_group, kernel.int16.unit)
    assert torch.equal(results[(layout, m, dtype, "planes")], planes)
    assert torch.equal(results[(layout, m, dtype, "scales")], scales)
    # Each sum is of integers (exact in float32) times the scale: one rounding either way.
    assert torch.equal(results[(layout, m, dtype, "sums")], sums)
    # Group 0 (all zeros) is zeros in both planes, wherever its pieces go; x[65] rounds to 0.
    unit, plane = kernel.int16.unit, kernel.int16.plane
    for start in (0, plane):
        for piece in range(GROUP // unit):
            at = start + unit * kernel.int16.order.index(piece)
            assert not planes[:, at : at + unit].any(), (start, piece)
    assert not int16_x.dequantized(planes, scales, kernel.int16.order, unit)[:, 65].any()


@pytest.mark.skipif(not INTEGER_DOT, reason="the int16-x kernels need AVX512-VNNI or AVX2 (this host has neither)")
@pytest.mark.parametrize("shared, rounded", [(True, 2), (False, 3)])
def test_products_of_one_x_share_its_rounding(shared, rounded):
    layout = INT16_X[0]
    w = WEIGHTS[layout]

    def products(x, blocks):
        times = BlockProducts() if shared else block_product
        weight = w.with_blocks(blocks)
        return times(x, weight) + times(x, weight), times(x * 2, weight)  # x twice, then another x

    mlir = str(export_function(products, (XS[1], w.blocks)).mlir_module)
    assert mlir.count("util.call @sharktank_int16_x_") == rounded
    assert mlir.count(f"util.call @sharktank_{layout.lower()}_product_") == 3


def test_int16_x_kernels_need_an_integer_dot():
    x = XS[1]
    for form in (*isa.INT8_DOTS, None):
        with isa.using(isa.Isa(int8_dot=form)):
            for layout in INT16_X:
                assert (block_product(x, WEIGHTS[layout]) is None) == (form is None), (layout, form)
            assert block_product(x, WEIGHTS["Q8_0"]) is not None  # float x: any x86 CPU


def test_shapes_whose_scratch_exceeds_the_stack_keep_the_torch_form():
    # A workgroup keeps its 64 weight rows' sums per row of x on the stack: 128 rows of x
    # need 32 KiB, more than IREE lets a CPU dispatch hold, so the product stays the torch form.
    w = QuantizedTensor(LAYOUTS["Q8_0"], (4, 256), torch.zeros(4, 8, 34, dtype=torch.uint8))
    assert block_product(torch.randn(128, 256), w) is None
    assert block_product(torch.randn(8, 256), w) is not None


def test_int16_x_pieces_smaller_than_a_group_are_placed_by_order():
    # The legacy kernels' planes of 64 values hold 16-value pieces in order (0, 2, 1, 3): the
    # same values as the natural order, each piece moved; dequantized undoes it.
    x = XS[3]
    natural, scales, sums = int16_x.quantize(x, (0, 1), unit=32)
    planes, scales16, sums16 = int16_x.quantize(x, (0, 2, 1, 3), unit=16)
    assert torch.equal(scales16, scales) and torch.equal(sums16, sums)
    assert torch.equal(planes.reshape(3, K // 64, 2, 4, 16), natural.reshape(3, K // 64, 2, 4, 16)[:, :, :, [0, 2, 1, 3]])
    assert torch.equal(int16_x.dequantized(planes, scales, (0, 2, 1, 3), 16), int16_x.dequantized(natural, scales, (0, 1)))
    with pytest.raises(ValueError, match="whole groups"):
        int16_x.plane_of((0, 1, 2), unit=16)
