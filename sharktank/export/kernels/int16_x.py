"""Activations as 16-bit integers, for the integer-dot kernels (Q4_K, Q6_K).

Each row of ``x`` is cut into groups of :data:`~.dispatch.GROUP` (32) values. A group's values
become ``v = round(x * LIMIT / max|x|)`` (``LIMIT`` = 32639), its scale is ``max|x| / LIMIT``
and the sum of each ``sum_group`` values is ``scale * sum(v)``: the sum of the values the kernel multiplies by, so that a
kernel's result is, up to float32 rounding, the product of the weights with
:func:`dequantized` ``x``. Each value moves by at most half a step, ``max|x| / 65278`` of its
group: far below bfloat16's own rounding (2^-9 of each value), so a bfloat16 model's products
hardly change (an 8192x2048 Q4_K product with random x: 2e-5 of its largest value, where int8
x, llama.cpp's choice, gave 5e-3 there and 0.13 of the largest logit in a test model).

A kernel takes each ``v`` as two int8 bytes, ``v = 256 * high + low`` (``high`` within
+-127, ``low`` within -128..127, which is why ``LIMIT`` is 127 * 256 + 127), because x86 has
an unsigned-by-signed byte dot product (``vpdpbusd``, :func:`.syntax.int8_dot`; AVX2's
``vpmaddubsw`` + ``vpmaddwd``, :meth:`.mlir.Emitter.int8_dot`) that takes
the weights' unsigned values as they are: ``256 * dot(q, high) + dot(q, low)`` costs two of
those for 64 values, against widening everything to 16 bits. Per plane of a row (``32 *
len(order)`` values: 256 for the K-quants, whose super-blocks have eight groups; 64 for the
legacy 32-value layouts, whose kernels take two blocks at once), the ``planes`` tensor holds
the plane's high bytes, then its low bytes, each with its groups in the kernel's ``order``.

:func:`quantize` is the scheme in torch (the eager form, and the reference); :func:`module_asm`
is the same as one hand-written dispatch, what export calls: in torch, IREE compiled each
rounding of x into 8 small dispatches (and one more per product taking it), about 540 of a
1B Q4_K-mix decode step's 1077 dispatches.
"""

from __future__ import annotations

import torch

from .block_kernel import GROUP
from .frame import Operand, executable
from .mlir import Emitter, Value, vector

__all__ = ["LIMIT", "PLANE", "plane_of", "quantize", "dequantized", "function_name", "module_asm"]

LIMIT = 127 * 256 + 127
PLANE = 256  # values per pair of planes of the K-quants (a super-block); plane_of(order) in general


def plane_of(order: tuple[int, ...], unit: int = GROUP) -> int:
    """Values per pair of planes for ``unit``-value pieces in ``order`` (a permutation of 0..len
    - 1; ``unit`` divides GROUP: a group's pieces may go to different places)."""
    if sorted(order) != list(range(len(order))):
        raise ValueError(f"int16 x: order {order} is not a permutation of 0..{len(order) - 1}")
    plane = unit * len(order)
    if GROUP % unit or plane % GROUP:
        raise ValueError(f"int16 x: pieces of {unit} values, {len(order)} a plane, do not make whole groups of {GROUP}")
    return plane


def quantize(x: torch.Tensor, order: tuple[int, ...], sum_group: int = GROUP, unit: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(planes, scales, sums)`` of float ``x`` ``[m, k]``: int8 ``[m, 2k]``, float32 ``[m,
    k/32]`` and ``[m, k/sum_group]`` (the sums of every ``sum_group`` values, a divisor of 32);
    ``order``: the ``unit``-value pieces of each plane (:func:`plane_of`) as the kernel reads them."""
    m, k = x.shape
    plane = plane_of(order, unit)
    if k % plane:
        raise ValueError(f"int16 x: K={k} is not a multiple of {plane}")
    g = x.float().reshape(m, k // GROUP, GROUP)
    top = g.abs().amax(-1, keepdim=True)
    # A division (LIMIT / top would be torch's 1 / top * LIMIT, two roundings), as the dispatch.
    inverse = torch.where(top > 0, torch.full_like(top, LIMIT) / top, torch.zeros_like(top))
    v = torch.round(g * inverse)
    scales = (top / LIMIT).squeeze(-1)
    sums = (v.reshape(m, k // GROUP, GROUP // sum_group, sum_group).sum(-1) * scales.unsqueeze(-1)).reshape(m, k // sum_group)
    high = torch.floor((v + 128) / 256)
    low = v - 256 * high
    planes = torch.stack([high, low], 1).to(torch.int8)  # [m, 2, k/32, 32]
    planes = planes.reshape(m, 2, k // plane, plane // unit, unit)[:, :, :, list(order)]
    return planes.permute(0, 2, 1, 3, 4).reshape(m, 2 * k), scales, sums


def dequantized(planes: torch.Tensor, scales: torch.Tensor, order: tuple[int, ...], unit: int = GROUP) -> torch.Tensor:
    """The float32 ``x`` a kernel multiplies by: ``(256 * high + low) * scale`` per value."""
    m, k, plane = planes.shape[0], planes.shape[1] // 2, plane_of(order, unit)
    p = planes.reshape(m, k // plane, 2, plane // unit, unit).float()
    v = 256 * p[:, :, 0] + p[:, :, 1]
    v = v[:, :, [order.index(j) for j in range(len(order))]].reshape(m, k // GROUP, GROUP)
    return (v * scales.unsqueeze(-1)).reshape(m, k)


def function_name(m: int, k: int, elem: str, order: tuple[int, ...], sum_group: int, unit: int = GROUP) -> str:
    pieces = "" if unit == GROUP else f"_u{unit}"
    return f"sharktank_int16_x_{m}x{k}_{elem}_o{''.join(map(str, order))}_s{sum_group}{pieces}"


def _group(e: Emitter, at: dict[str, Value], mem: dict[str, Value], elem: str, j: int, places: list[int], sum_group: int, plane: int) -> None:
    """Group ``j`` of the plane at ``at["k"]`` (its planes at ``at["k2"]``), its pieces stored
    at value offsets ``places`` of the plane."""
    v, vi, vb = vector(32, "f32"), vector(32, "i32"), vector(32, "i8")
    row, c = at["row"], e.const
    col = e.binary("arith.addi", at["k"], c(GROUP * j), "col")
    x = e.load(mem["x"], [row, col], vector(32, elem), "x")
    if elem != "f32":
        x = e.cast("arith.extf", x, v, "x")
    top = e.reduction("maxnumf", e.unary("math.absf", x, "abs"), "top")
    f0, limit = c(0.0, "f32"), c(float(LIMIT), "f32")
    positive = e.cmp("arith.cmpf", "ogt", top, f0, "pos")
    inverse = e.select(positive, e.binary("arith.divf", limit, top, "q"), f0, "inv")
    scale = e.binary("arith.divf", top, limit, "sc")
    scaled = e.binary("arith.mulf", x, e.broadcast(inverse, v), "m")
    rounded = e.unary("math.roundeven", scaled, "v")  # torch.round: halves to even
    vi_ = e.cast("arith.fptosi", rounded, vi, "vi")
    high = e.binary("arith.shrsi", e.binary("arith.addi", vi_, c(128, vi), "hp"), c(8, vi), "h")  # floor((v + 128) / 256)
    low = e.binary("arith.subi", vi_, e.binary("arith.shli", high, c(8, vi), "hs"), "l")
    unit = GROUP // len(places)
    for start, value in ((0, high), (plane, low)):
        value = e.cast("arith.trunci", value, vb, "b")
        for piece, place in enumerate(places):
            part = value if unit == GROUP else e.slice(value, piece * unit, unit, "bp")
            e.store(part, mem["planes"], [row, e.binary("arith.addi", at["k2"], c(start + place), "pc")])
    e.store_scalar(scale, mem["scales"], [row, e.binary("arith.addi", at["g8"], c(j), "g")])
    per = GROUP // sum_group
    for h in range(per):  # sums of the rounded values (exact in float32), times the scale
        part = rounded if per == 1 else e.slice(rounded, h * sum_group, sum_group, "vp")
        total = e.binary("arith.mulf", e.reduction("add", part, "t"), scale, "ts")
        e.store_scalar(total, mem["sums"], [row, e.binary("arith.addi", at["s8"], c(j * per + h), "si")])


def module_asm(m: int, k: int, elem: str, order: tuple[int, ...], sum_group: int, unit: int = GROUP) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>) -> (planes, scales,
    sums)``, :func:`quantize`'s results (``elem``: f32, bf16 or f16), and its dispatch: one
    workgroup per row of x, a loop over its planes (:func:`plane_of` values each)."""
    plane = plane_of(order, unit)
    if k % plane:
        raise ValueError(f"int16 x: K={k} is not a multiple of {plane}")
    if GROUP % sum_group:
        raise ValueError(f"int16 x: {sum_group} does not divide {GROUP}")
    outputs = [Operand("planes", (m, 2 * k), "i8"), Operand("scales", (m, k // GROUP), "f32"), Operand("sums", (m, k // sum_group), "f32")]

    def body(e: Emitter, row: Value, views: list[Value]) -> None:
        mem = dict(zip(("x", "planes", "scales", "sums"), views))
        c = e.const

        def super_block(b: Value, _):
            kcol = e.binary("arith.muli", b, c(plane), "k")
            at = dict(row=row, k=kcol, k2=e.binary("arith.addi", kcol, kcol, "k2"))
            groups, per = plane // GROUP, GROUP // unit
            at["g8"] = e.binary("arith.muli", b, c(groups), "g8")
            at["s8"] = e.binary("arith.muli", b, c(groups * (GROUP // sum_group)), "s8")
            for j in range(groups):  # piece u of the plane (natural order) goes to place order.index(u)
                places = [unit * order.index(j * per + i) for i in range(per)]
                _group(e, at, mem, elem, j, places, sum_group, plane)

        e.for_(c(0), c(k // plane), c(1), super_block, hint="b")

    return executable(function_name(m, k, elem, order, sum_group, unit), m, [Operand("x", (m, k), elem)], outputs, body)
