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

Written in torch: traced, IREE fuses it into small dispatches before the kernel's.
"""

from __future__ import annotations

import torch

from .dispatch import GROUP

__all__ = ["LIMIT", "quantize", "dequantized"]

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
    inverse = torch.where(top > 0, LIMIT / top, torch.zeros_like(top))
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
