"""The CPU kernels' form for a mixture of experts' stacked weights (a decode step's chosen
experts read in place: ``block_product(..., expert=indexes)``), for every kernel of the
registry, compiled, against float64 products with each pair's expert's weight (dequantized by
the gguf package for the block layouts). The indexes are program inputs, so the compiled
dispatch reads them from data; the program runs with two sets of them.

One exported program holds every case (one compile): E = 3 stacked experts of N = 71 weight
rows (a full workgroup of 64 and a remainder of 7) and K = 512, in float32: one pair of 1 or 3
rows of x (one expert), and 4 pairs of one row each (4 experts, repeats included, in one
dispatch); weights whose float16 scales are positive, negative and 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quantized_models import signed_blocks

from sharktank.export import compile_mlir, export_function
from sharktank.export.compile import QUANTIZED_FLAGS
from sharktank.export.kernels import INTEGER_DOT, KERNELS, block_product, int16_x, kernels_in
from sharktank.runtime import Session
from sharktank.types import QuantizedTensor

from test_cpu_kernels import _check, _gguf_values

E, N, K = 3, 71, 512
# The int16-x kernels need an integer dot product (AVX512-VNNI or AVX2).
KINDS = [name for name, kernel in KERNELS.items() if INTEGER_DOT or not kernel.int16_x]
PLAIN = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def _stacked(name: str, seed: int):
    """``E`` experts' weights ``[E, N, K]`` of ``name``: valid random blocks, or plain values."""
    if name in PLAIN:
        return (torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed)) * 0.05).to(PLAIN[name])
    parts = [signed_blocks(name, N, K, seed * 10 + e, 1e-3) for e in range(E)]
    return QuantizedTensor(parts[0].layout, (E, N, K), torch.stack([p.blocks for p in parts]))


WEIGHTS = {name: _stacked(name, i) for i, name in enumerate(KINDS)}
# (rows per pair, pairs): one expert over 1 or 3 rows (batched decode's form), 4 pairs of a row.
SHAPES = ((1, 1), (3, 1), (1, 4))
CASES = [(name, m, pairs) for name in KINDS for m, pairs in SHAPES]
# Two sets of the indexes: for one pair, and for 4 pairs.
INDEXES = (([0], [2, 0, 2, 1]), ([E - 1], [1, 1, 0, 2]))
XS = {(m, pairs): torch.randn(m * pairs, K, generator=torch.Generator().manual_seed(10 * m + pairs)) for m, pairs in SHAPES}


def _operand(w):
    return w.blocks if isinstance(w, QuantizedTensor) else w


def _with(w, operand):
    return w.with_blocks(operand) if isinstance(w, QuantizedTensor) else operand


def _products(one, four, *args):
    xs = dict(zip(XS, args[: len(XS)]))
    weights = dict(zip(KINDS, args[len(XS) :]))
    return tuple(
        block_product(xs[m, pairs], _with(WEIGHTS[name], weights[name]), expert=one if pairs == 1 else four).float()
        for name, m, pairs in CASES
    )


def _reference(name: str, m: int, indexes: list[int]) -> torch.Tensor:
    x = XS[m, len(indexes)]
    kernel = KERNELS[name]
    if kernel.int16_x:  # the x these kernels multiply by
        order, unit = kernel.int16.order, kernel.int16.unit
        x = int16_x.dequantized(*int16_x.quantize(x, order, unit=unit)[:2], order, unit)
    w = WEIGHTS[name]
    out = []
    for p, expert in enumerate(indexes):
        if isinstance(w, QuantizedTensor):
            values = _gguf_values(QuantizedTensor(w.layout, (N, K), w.blocks[expert]))
        else:
            values = w[expert].double()
        out.append(x[p * m : (p + 1) * m].double() @ values.T)
    return torch.cat(out)


@pytest.fixture(scope="module")
def compiled():
    args = (torch.tensor(INDEXES[0][0]), torch.tensor(INDEXES[0][1]), *XS.values(), *(_operand(WEIGHTS[name]) for name in KINDS))
    mlir = str(export_function(_products, args).mlir_module)
    session = Session(compile_mlir(mlir, 1, extra=QUANTIZED_FLAGS), 1)
    import iree.runtime as rt

    def placed(a: torch.Tensor):
        if a.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, typed for the device
            return session.place(a.view(torch.int16).numpy().view(np.uint16), 0, rt.HalElementType.BFLOAT_16)
        return session.place(a.numpy(), 0)

    results = {}
    for run, (one, four) in enumerate(INDEXES):
        inputs = [placed(torch.tensor(one)), placed(torch.tensor(four)), *(placed(a) for a in args[2:])]
        out = session.invoke("main", inputs)
        results.update({(*case, run): torch.from_numpy(np.array(r.to_host())) for case, r in zip(CASES, out, strict=True)})
    return mlir, results


def test_every_kernel_has_a_stacked_form_in_the_export(compiled):
    mlir, _ = compiled
    assert kernels_in(mlir) == sorted(name.lower() for name in KINDS)
    for name, m, pairs in CASES:
        kernel = KERNELS[name]
        elem = "i16" if kernel.int16_x else "f32"
        assert f"@{kernel.function_name(m, N, K, elem, 'f32', experts=E, pairs=pairs)}(" in mlir


@pytest.mark.parametrize("run", [0, 1])
@pytest.mark.parametrize("name, m, pairs", CASES, ids=[f"{n}-m{m}-p{p}" for n, m, p in CASES])
def test_each_pair_s_product_with_its_expert(compiled, name, m, pairs, run):
    _, results = compiled
    indexes = INDEXES[run][0 if pairs == 1 else 1]
    want = _reference(name, m, indexes)
    _check(results[(name, m, pairs, run)], want, torch.float32)
    # Eagerly, the torch form of the same op.
    _check(block_product(XS[m, pairs], WEIGHTS[name], expert=torch.tensor(indexes)).float(), want, torch.float32)
