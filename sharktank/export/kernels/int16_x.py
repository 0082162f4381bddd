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
an unsigned-by-signed byte dot product (``vpdpbusd``, :func:`.syntax.int8_dot`) that takes
the weights' unsigned values as they are: ``256 * dot(q, high) + dot(q, low)`` costs two of
those for 64 values, against widening everything to 16 bits. Per 256 values of a row, the
``planes`` tensor holds the 256 high bytes, then the 256 low bytes, each with its eight groups
in the kernel's ``order``.

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

__all__ = ["LIMIT", "PLANE", "quantize", "dequantized", "function_name", "module_asm"]

LIMIT = 127 * 256 + 127
PLANE = 256  # values per pair of planes (a K-quant super-block)


def quantize(x: torch.Tensor, order: tuple[int, ...], sum_group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(planes, scales, sums)`` of float ``x`` ``[m, k]``: int8 ``[m, 2k]``, float32 ``[m,
    k/32]`` and ``[m, k/sum_group]`` (the sums of every ``sum_group`` values, a divisor of 32);
    ``order``: the groups of each 256 values as the kernel reads them."""
    m, k = x.shape
    if k % PLANE:
        raise ValueError(f"int16 x: K={k} is not a multiple of {PLANE}")
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
    planes = planes.reshape(m, 2, k // PLANE, PLANE // GROUP, GROUP)[:, :, :, list(order)]
    return planes.permute(0, 2, 1, 3, 4).reshape(m, 2 * k), scales, sums


def dequantized(planes: torch.Tensor, scales: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """The float32 ``x`` a kernel multiplies by: ``(256 * high + low) * scale`` per value."""
    m, k = planes.shape[0], planes.shape[1] // 2
    p = planes.reshape(m, k // PLANE, 2, PLANE // GROUP, GROUP).float()
    v = 256 * p[:, :, 0] + p[:, :, 1]
    v = v[:, :, [order.index(j) for j in range(len(order))]].reshape(m, k // GROUP, GROUP)
    return (v * scales.unsqueeze(-1)).reshape(m, k)


def function_name(m: int, k: int, elem: str, order: tuple[int, ...], sum_group: int) -> str:
    return f"sharktank_int16_x_{m}x{k}_{elem}_o{''.join(map(str, order))}_s{sum_group}"


def _group(e: Emitter, at: dict[str, Value], mem: dict[str, Value], elem: str, j: int, p: int, sum_group: int) -> None:
    """Group ``j`` of the super-block at ``at["k"]`` (its planes at ``at["k2"]``), stored at
    position ``p``."""
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
    for plane, value in ((0, high), (PLANE, low)):
        where = e.binary("arith.addi", at["k2"], c(plane + GROUP * p), "pc")
        e.store(e.cast("arith.trunci", value, vb, "b"), mem["planes"], [row, where])
    e.store_scalar(scale, mem["scales"], [row, e.binary("arith.addi", at["g8"], c(j), "g")])
    per = GROUP // sum_group
    for h in range(per):  # sums of the rounded values (exact in float32), times the scale
        part = rounded if per == 1 else e.slice(rounded, h * sum_group, sum_group, "vp")
        total = e.binary("arith.mulf", e.reduction("add", part, "t"), scale, "ts")
        e.store_scalar(total, mem["sums"], [row, e.binary("arith.addi", at["s8"], c(j * per + h), "si")])


def module_asm(m: int, k: int, elem: str, order: tuple[int, ...], sum_group: int) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>) -> (planes, scales,
    sums)``, :func:`quantize`'s results (``elem``: f32, bf16 or f16), and its dispatch: one
    workgroup per row of x, a loop over its super-blocks of 256 values."""
    if k % PLANE:
        raise ValueError(f"int16 x: K={k} is not a multiple of {PLANE}")
    if sorted(order) != list(range(PLANE // GROUP)) or GROUP % sum_group:
        raise ValueError(f"int16 x: order {order} is not a permutation of 0..7, or {sum_group} does not divide {GROUP}")
    outputs = [Operand("planes", (m, 2 * k), "i8"), Operand("scales", (m, k // GROUP), "f32"), Operand("sums", (m, k // sum_group), "f32")]

    def body(e: Emitter, row: Value, views: list[Value]) -> None:
        mem = dict(zip(("x", "planes", "scales", "sums"), views))
        c = e.const

        def super_block(b: Value, _):
            kcol = e.binary("arith.muli", b, c(PLANE), "k")
            at = dict(row=row, k=kcol, k2=e.binary("arith.addi", kcol, kcol, "k2"))
            at["g8"] = e.binary("arith.muli", b, c(8), "g8")
            at["s8"] = e.binary("arith.muli", b, c(8 * (GROUP // sum_group)), "s8")
            for p in range(len(order)):
                _group(e, at, mem, elem, order[p], p, sum_group)

        e.for_(c(0), c(k // PLANE), c(1), super_block, hint="b")

    return executable(function_name(m, k, elem, order, sum_group), m, [Operand("x", (m, k), elem)], outputs, body)
