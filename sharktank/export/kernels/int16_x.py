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
an unsigned-by-signed byte dot product (``vpdpbusd``, :func:`.dispatch.int8_dot`) that takes
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

from .dispatch import GROUP

__all__ = ["LIMIT", "quantize", "dequantized", "function_name", "module_asm"]

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


def _group(j: int, p: int, sum_group: int, elem: str, x_t: str, planes_t: str, scales_t: str, sums_t: str) -> str:
    """Group ``j`` of the super-block at ``%k`` (its planes at ``%k2``), stored at position ``p``."""
    v, vi, vb = "vector<32xf32>", "vector<32xi32>", "vector<32xi8>"
    load = f"vector.load %x[%row, %col{j}] : {x_t}, vector<32x{elem}>"
    lines = [f"%at{j} = arith.constant {GROUP * j} : index", f"%col{j} = arith.addi %k, %at{j} : index"]
    lines += [f"%x{j} = {load}"] if elem == "f32" else [f"%xe{j} = {load}", f"%x{j} = arith.extf %xe{j} : vector<32x{elem}> to {v}"]
    lines += [
        f"%abs{j} = math.absf %x{j} : {v}",
        f"%top{j} = vector.reduction <maxnumf>, %abs{j} : {v} into f32",
        f"%pos{j} = arith.cmpf ogt, %top{j}, %f0 : f32",
        f"%q{j} = arith.divf %limit, %top{j} : f32",
        f"%inv{j} = arith.select %pos{j}, %q{j}, %f0 : f32",
        f"%sc{j} = arith.divf %top{j}, %limit : f32",
        f"%invv{j} = vector.broadcast %inv{j} : f32 to {v}",
        f"%m{j} = arith.mulf %x{j}, %invv{j} : {v}",
        f"%v{j} = math.roundeven %m{j} : {v}",  # torch.round: halves to even
        f"%vi{j} = arith.fptosi %v{j} : {v} to {vi}",
        f"%hp{j} = arith.addi %vi{j}, %i128 : {vi}",
        f"%h{j} = arith.shrsi %hp{j}, %i8 : {vi}",  # floor((v + 128) / 256)
        f"%hs{j} = arith.shli %h{j}, %i8 : {vi}",
        f"%l{j} = arith.subi %vi{j}, %hs{j} : {vi}",
        f"%hb{j} = arith.trunci %h{j} : {vi} to {vb}",
        f"%lb{j} = arith.trunci %l{j} : {vi} to {vb}",
        f"%ph{j}_at = arith.constant {GROUP * p} : index",
        f"%ph{j} = arith.addi %k2, %ph{j}_at : index",
        f"vector.store %hb{j}, %planes[%row, %ph{j}] : {planes_t}, {vb}",
        f"%pl{j}_at = arith.constant {PLANE + GROUP * p} : index",
        f"%pl{j} = arith.addi %k2, %pl{j}_at : index",
        f"vector.store %lb{j}, %planes[%row, %pl{j}] : {planes_t}, {vb}",
        f"%g{j}_at = arith.constant {j} : index",
        f"%g{j} = arith.addi %g8, %g{j}_at : index",
        f"memref.store %sc{j}, %scales[%row, %g{j}] : {scales_t}",
    ]
    per = GROUP // sum_group
    for h in range(per):  # sums of the rounded values (exact in float32), times the scale
        part = f"%v{j}" if per == 1 else f"%vp{j}_{h}"
        if per > 1:
            lines.append(f"{part} = vector.extract_strided_slice %v{j} {{offsets = [{h * sum_group}], sizes = [{sum_group}], strides = [1]}} : {v} to vector<{sum_group}xf32>")
        lines += [
            f"%t{j}_{h} = vector.reduction <add>, {part} : vector<{sum_group}xf32> into f32",
            f"%ts{j}_{h} = arith.mulf %t{j}_{h}, %sc{j} : f32",
            f"%s{j}_{h}_at = arith.constant {j * per + h} : index",
            f"%s{j}_{h} = arith.addi %s8, %s{j}_{h}_at : index",
            f"memref.store %ts{j}_{h}, %sums[%row, %s{j}_{h}] : {sums_t}",
        ]
    return "\n".join(lines)


def module_asm(m: int, k: int, elem: str, order: tuple[int, ...], sum_group: int) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>) -> (planes, scales,
    sums)``, :func:`quantize`'s results (``elem``: f32, bf16 or f16), and its dispatch: one
    workgroup per row of x, a loop over its super-blocks of 256 values."""
    if k % PLANE:
        raise ValueError(f"int16 x: K={k} is not a multiple of {PLANE}")
    if sorted(order) != list(range(PLANE // GROUP)) or GROUP % sum_group:
        raise ValueError(f"int16 x: order {order} is not a permutation of 0..7, or {sum_group} does not divide {GROUP}")
    name, ng, ns = function_name(m, k, elem, order, sum_group), k // GROUP, k // sum_group
    x_t = f"memref<{m}x{k}x{elem}, strided<[{k}, 1], offset: ?>>"
    planes_t = f"memref<{m}x{2 * k}xi8, strided<[{2 * k}, 1], offset: ?>>"
    scales_t = f"memref<{m}x{ng}xf32, strided<[{ng}, 1], offset: ?>>"
    sums_t = f"memref<{m}x{ns}xf32, strided<[{ns}, 1], offset: ?>>"
    groups = "\n".join(_group(order[p], p, sum_group, elem, x_t, planes_t, scales_t, sums_t) for p in range(len(order)))
    x_tensor, p_tensor = f"tensor<{m}x{k}x{elem}>", f"tensor<{m}x{2 * k}xi8>"
    g_tensor, s_tensor = f"tensor<{m}x{ng}xf32>", f"tensor<{m}x{ns}xf32>"
    body = "\n".join(" " * 8 + line for line in groups.splitlines())
    return f"""module {{
stream.executable private @{name}_exe {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %g = arith.constant {m} : index
    %one = arith.constant 1 : index
    stream.return %g, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xb: !stream.binding, %pb: !stream.binding, %db: !stream.binding, %sb: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
      %cs8 = arith.constant {8 * (GROUP // sum_group)} : index
      %cplane = arith.constant {PLANE} : index
      %csb = arith.constant {k // PLANE} : index
      %f0 = arith.constant 0.0 : f32
      %limit = arith.constant {float(LIMIT)} : f32
      %i128 = arith.constant dense<128> : vector<32xi32>
      %i8 = arith.constant dense<8> : vector<32xi32>
      %x = stream.binding.subspan %xb[%c0] : !stream.binding -> {x_t}
      %planes = stream.binding.subspan %pb[%c0] : !stream.binding -> {planes_t}
      %scales = stream.binding.subspan %db[%c0] : !stream.binding -> {scales_t}
      %sums = stream.binding.subspan %sb[%c0] : !stream.binding -> {sums_t}
      %row = stream.dispatch.workgroup.id[0] : index
      scf.for %b = %c0 to %csb step %c1 {{
        %k = arith.muli %b, %cplane : index
        %k2 = arith.addi %k, %k : index
        %g8 = arith.muli %b, %c8 : index
        %s8 = arith.muli %b, %cs8 : index
{body}
      }}
      return
    }}
  }}
}}
util.func private @{name}(%x: {x_tensor}) -> ({p_tensor}, {g_tensor}, {s_tensor}) {{
  %p, %d, %s = flow.dispatch @{name}_exe::@{name}(%x) : ({x_tensor}) -> ({p_tensor}, {g_tensor}, {s_tensor})
  util.return %p, %d, %s : {p_tensor}, {g_tensor}, {s_tensor}
}}
}}
"""
