"""Every hand-written dispatch the generators can write, parsed (not compiled) by the MLIR
parser of the IREE compiler in use: layout x x dtype x rows of x x weight rows at once, x's
int16 rounding, decode attention; the int16-x kernels in every integer dot form (:mod:`.isa`). A value defined twice (two bodies, or one body emitted twice,
picking the same name) or a type that does not match its use fails the parse, in milliseconds
a module, where a compile would take seconds."""

from __future__ import annotations

import dataclasses
import re

import pytest
from iree.compiler import ir

from sharktank.export.kernels import KERNELS, LAYOUTS, attention, int16_x, isa, kernels_in, prefill
from sharktank.export.kernels.registry import PREFILLS
from sharktank.export.kernels.block_kernel import BATCH_TILES, STACK_BYTES, X_CHUNK_BYTES
from sharktank.export.kernels.mlir import Emitter
from sharktank.export.kernels.product_dispatch import module_asm
from sharktank.types.quantized import LAYOUTS as BLOCK_LAYOUTS

N = 67  # odd: a full workgroup and a remainder
ROWS = (1, 3, 8)
AT_ONCE = (1, 2, 4)
MATRIX = [(layout, elem, m, r) for layout in KERNELS for elem in KERNELS[layout].elements for m in ROWS for r in AT_ONCE]
_DEFINED = re.compile(r"(%[A-Za-z_][\w]*)(?::\d+)?\s*=")


@pytest.fixture(scope="module")
def context():
    return ir.Context()


def _parse(context, text: str) -> None:
    ir.Module.parse(text, context)


def _k(layout: str) -> int:
    """A K whose one row of x (2 bytes a value at the least) is past X_CHUNK_BYTES, so that one
    row of x takes the rows-at-once path."""
    size = KERNELS[layout].block_size
    return -(-X_CHUNK_BYTES // (2 * size)) * size


def _names_are_generated(text: str) -> None:
    names = _DEFINED.findall(text)
    assert len(names) == len(set(names)), "a value name is defined twice"
    assert all(re.fullmatch(r"%[A-Za-z_]\w*_\d+", n) for n in names), [n for n in names if not re.fullmatch(r"%[A-Za-z_]\w*_\d+", n)][:5]


@pytest.mark.parametrize("layout", list(KERNELS))
def test_the_stacked_experts_form_parses_and_reads_its_expert_in_place(context, layout):
    # A mixture of experts' decode product: every expert's weight and the chosen one's index;
    # the dispatch views that expert's weight (a subview of the stacked binding) and reads it
    # as the one-weight form reads its weight.
    kernel = KERNELS[layout]
    for elem in kernel.elements:
        for m in (1, 3):
            text = module_asm(kernel, m, N, _k(layout), elem, experts=8)
            _names_are_generated(text)
            _parse(context, text)
            assert f"func.func @{kernel.function_name(m, N, _k(layout), elem, experts=8)}(" in text
            assert text.count("memref.subview") == 1 and "tensor<1xi64>" in text
            one = module_asm(kernel, m, N, _k(layout), elem)
            # The loop over the blocks is the one-weight form's, with the subview for its weight.
            assert one.count("vector.load") == text.count("vector.load")


@pytest.mark.parametrize("layout, elem, m, at_once", MATRIX, ids=[f"{lay}-{e}-m{m}-r{r}" for lay, e, m, r in MATRIX])
def test_block_product_parses(context, layout, elem, m, at_once):
    kernel = dataclasses.replace(KERNELS[layout], rows_at_once=at_once)
    k = _k(layout)
    # The int16-x kernels in each integer dot form (isa.py), whatever this host has; the float-x
    # ones in both register widths.
    for form in isa.INT8_DOTS if elem == "i16" else (isa.HOST.int8_dot, *isa.INT8_DOTS):
        with isa.using(isa.Isa(int8_dot=form)):
            tile = None if elem == "i16" else BATCH_TILES.get(64 if form == "avx512_vnni" else 32)
            assert kernel.rows_together(m, k, elem) == (at_once if m == 1 else tile.weight_rows if tile else 1)
            for y in {"f32", "bf16"}:
                text = module_asm(kernel, m, N, k, elem, y)
                _names_are_generated(text)
                _parse(context, text)
                if elem == "i16":
                    assert ("avx512.vpdpbusd" in text) == (form == "avx512_vnni") and ("avx2.pmadd" in text) == (form == "avx2")


@pytest.mark.parametrize("form", isa.BF16_DOTS)
@pytest.mark.parametrize("layout", sorted(PREFILLS))
def test_prefill_product_parses(context, layout, form):
    weights = PREFILLS[layout]
    with isa.using(isa.Isa(bf16_dot=form)):
        text = prefill.module_asm(weights, 64, 4 * max(weights.block_size, 64))
    _names_are_generated(text)
    _parse(context, text)
    assert ("dpbf16ps" in text) == (form == "avx512_bf16")


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if KERNELS[layout].int16_x])
@pytest.mark.parametrize("elem", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("m", ROWS)
def test_int16_rounding_parses(context, layout, elem, m):
    kernel = KERNELS[layout]
    text = int16_x.module_asm(m, 512, elem, kernel.int16.order, kernel.sum_group)
    _names_are_generated(text)
    _parse(context, text)


@pytest.mark.parametrize("h, kvh", [(8, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("q_elem, kv_elem", [("f32", "f32"), ("f32", "bf16"), ("bf16", "bf16"), ("f16", "f16")])
def test_decode_attention_parses(context, h, kvh, q_elem, kv_elem):
    text = attention.module_asm(2, h, 32, kvh, 64, q_elem, kv_elem, 0.125)
    _names_are_generated(text)
    _parse(context, text)


@pytest.mark.parametrize("n, m", [(4, 12), (8, 2), (12, 4), (16, 3), (32, 2)])  # whole pages a chunk, a page per entry, a chunk a page
@pytest.mark.parametrize("h, kvh", [(8, 2), (4, 4)])
def test_paged_decode_attention_parses(context, n, m, h, kvh):
    text = attention.paged_module_asm(2, h, m, n, kvh, 64, "f32", "bf16", 0.125)
    assert f"memref<?x{n}x{kvh}x64xbf16" in text  # the pool's page count: dynamic
    _names_are_generated(text)
    _parse(context, text)


@pytest.mark.parametrize("n", [4, 12, 16, 32])
@pytest.mark.parametrize("e", [64, 8, 24])  # folded scores (a multiple of 16) and scalar ones
def test_paged_prefill_attention_parses(context, n, e):
    text = attention.paged_prefill_module_asm(2, 8, n, 2, e, "bf16", "f32", 0.125)
    # Pools, rows, the (transposed) table's width and the flat mask: dynamic.
    assert f"memref<?x{n}x2x{e}xf32" in text and f"tensor<?x8x{e}xbf16>" in text and "tensor<?x2xi64>" in text and "tensor<?xi8>" in text
    _names_are_generated(text)
    _parse(context, text)
    assert kernels_in(text) == ["paged_prefill_attention"]


def test_the_parse_catches_a_name_defined_twice(context):
    # What the matrix relies on: the parser rejects a clash (and the emitter never makes one).
    clash = "func.func @f() {\n  %a = arith.constant 0 : index\n  %a = arith.constant 1 : index\n  return\n}"
    with pytest.raises(Exception, match="redefinition of SSA value '%a'"):
        _parse(context, clash)
    e = Emitter()
    assert len({e.fresh("a") for _ in range(100)} | {e.fresh("a_1") for _ in range(100)}) == 200


def test_the_emitter_checks_types_and_yields():
    e = Emitter()
    i, f = e.const(1), e.const(1.0, "f32")
    with pytest.raises(ValueError, match="operands of one type expected, found index and f32"):
        e.binary("arith.addi", i, f)
    with pytest.raises(ValueError, match=r"yields \['index'\], expected \['f32'\]"):
        e.for_(i, i, i, lambda iv, carried: [iv], [f])
    assert e.const(1) is i  # a constant is made once per region


def test_the_registry_is_the_one_source():
    assert LAYOUTS == tuple(name for name in KERNELS if name not in ("F16", "BF16", "F32"))
    assert KERNELS["F16"].plain and KERNELS["F16"].weight_shape(N, 64) == (N, 64)
    assert KERNELS["BF16"].plain and KERNELS["BF16"].weight == "bf16"
    assert KERNELS["F32"].plain and KERNELS["F32"].weight == "f32" and KERNELS["F32"].prefill is None
    for name, kernel in KERNELS.items():
        assert kernel.name == name.lower()
        if not kernel.plain:
            assert kernel.layout is BLOCK_LAYOUTS[name] and kernel.weight_shape(N, 512) == (N, 512 // kernel.block_size, kernel.block_bytes)
        k = 8 * kernel.block_size
        # The manifest's cpu_kernels: found from the registered names in a module's text.
        assert kernels_in(module_asm(kernel, 1, N, k, kernel.elements[0])) == [kernel.name]
        # The fit checks: what the generator refuses, with what it expected and found.
        assert kernel.refusal(1, N, kernel.block_size + 1, kernel.elements[0]) is not None
        too_many = STACK_BYTES // (4 * kernel.rows_per_workgroup) + 1
        assert "bytes of scratch" in kernel.refusal(too_many, N, k, kernel.elements[0])
        with pytest.raises(ValueError, match=f"{name} kernel: activations of type i8 are not supported"):
            module_asm(kernel, 1, N, k, "i8")
