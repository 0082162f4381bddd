"""The CPU kernels' form for a mixture of experts' stacked weights (a decode step's chosen
expert read in place: ``block_product(..., expert=i)``), for every kernel of the registry,
compiled, against float64 products with the chosen expert's weight (dequantized by the gguf
package for the block layouts). The expert index is a program input, so the compiled
dispatch reads it from data; each program runs with the first and the last expert.

One exported program holds every case (one compile): E = 3 stacked experts of N = 71 weight
rows (a full workgroup of 64 and a remainder of 7) and K = 512, x of 1 and 3 rows in float32,
weights whose float16 scales are positive, negative and 0."""

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
ROWS = (1, 3)
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
XS = {m: torch.randn(m, K, generator=torch.Generator().manual_seed(m)) for m in ROWS}
CASES = [(name, m) for name in KINDS for m in ROWS]


def _operand(w):
    return w.blocks if isinstance(w, QuantizedTensor) else w


def _with(w, operand):
    return w.with_blocks(operand) if isinstance(w, QuantizedTensor) else operand


def _products(expert, *args):
    xs = dict(zip(XS, args[: len(XS)]))
    weights = dict(zip(KINDS, args[len(XS) :]))
    return tuple(block_product(xs[m], _with(WEIGHTS[name], weights[name]), expert=expert).float() for name, m in CASES)


def _reference(name: str, m: int, expert: int) -> torch.Tensor:
    x = XS[m]
    kernel = KERNELS[name]
    if kernel.int16_x:  # the x these kernels multiply by
        order, unit = kernel.int16.order, kernel.int16.unit
        x = int16_x.dequantized(*int16_x.quantize(x, order, unit=unit)[:2], order, unit)
    w = WEIGHTS[name]
    if isinstance(w, QuantizedTensor):
        one = QuantizedTensor(w.layout, (N, K), w.blocks[expert])
        values = _gguf_values(one)
    else:
        values = w[expert].double()
    return x.double() @ values.T


@pytest.fixture(scope="module")
def compiled():
    args = (torch.tensor([0]), *XS.values(), *(_operand(WEIGHTS[name]) for name in KINDS))
    mlir = str(export_function(_products, args).mlir_module)
    session = Session(compile_mlir(mlir, 1, extra=QUANTIZED_FLAGS), 1)
    import iree.runtime as rt

    def placed(a: torch.Tensor):
        if a.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, typed for the device
            return session.place(a.view(torch.int16).numpy().view(np.uint16), 0, rt.HalElementType.BFLOAT_16)
        return session.place(a.numpy(), 0)

    results = {}
    for expert in (0, E - 1):
        inputs = [placed(torch.tensor([expert])), *(placed(a) for a in args[1:])]
        out = session.invoke("main", inputs)
        results.update({(name, m, expert): torch.from_numpy(np.array(r.to_host())) for (name, m), r in zip(CASES, out, strict=True)})
    return mlir, results


def test_every_kernel_has_a_stacked_form_in_the_export(compiled):
    mlir, _ = compiled
    assert kernels_in(mlir) == sorted(name.lower() for name in KINDS)
    for name, m in CASES:
        kernel = KERNELS[name]
        elem = "i16" if kernel.int16_x else "f32"
        assert f"@{kernel.function_name(m, N, K, elem, 'f32', experts=E)}(" in mlir


@pytest.mark.parametrize("expert", [0, E - 1])
@pytest.mark.parametrize("name, m", CASES, ids=[f"{n}-m{m}" for n, m in CASES])
def test_the_chosen_expert_s_product(compiled, name, m, expert):
    _, results = compiled
    want = _reference(name, m, expert)
    _check(results[(name, m, expert)], want, torch.float32)
    # Eagerly, the torch form of the same op.
    _check(block_product(XS[m], WEIGHTS[name], expert=torch.tensor([expert])).float(), want, torch.float32)
