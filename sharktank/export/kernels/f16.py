"""Plain float16 weights (an F16 GGUF's, a float16 model's) in the hand-written products, read
as stored (``[N, K]``), 32 values a block: a decode step's product in the frame of
:mod:`.product_dispatch` (the values widened to float32 and multiplied with float32 x, as
Q8_0's), a prompt's in the prefill dispatch (:mod:`.prefill`: the values rounded to bfloat16
in its tile).

Why: this CPU has no float16 arithmetic, and IREE 3.10's llvm-cpu code for a float16 product
converts as it goes: a 128x1536x576 product took 3.0 ms in float16 against 1.1 ms in bfloat16
and 1.0 ms in the prefill dispatch (``tools/bench_products.py``). The decode kernel is there so
that no dense product reads the weight: IREE packs the weight of a dense product once at load
into a copy of its own (data tiling), which the prefill dispatch's reads of the stored weight
would have kept beside it (SmolLM2's F16 file: 848 MiB peak against 598).

Numerics: a decode step's products are the float16 values times float32 x summed in float32
(x rounded to float32 only where it is wider); a prompt's keep 8 of float16's 11 significant
bits of the weight and of x, summed in float32. ``export --exact-prompts`` keeps a float16
prompt's dense product.
"""

from __future__ import annotations

from .block_kernel import BlockKernel
from .mlir import Value
from .product_dispatch import Block

__all__ = ["KERNEL", "VALUES", "body", "values"]

VALUES = 32  # values per block: one 64-byte load


def body(blk: Block) -> None:
    """A plain weight's block: its values widened to float32 times x's."""
    blk.accumulate(blk.plain(VALUES), 0)


def values(blk: Block) -> list[tuple[int, Value]]:
    return [(0, blk.plain(VALUES))]


KERNEL = BlockKernel("F16", body, rows_per_workgroup=64, rows_at_once=4, accumulators=(32,), values=values, weight="f16", plain_block=VALUES)
