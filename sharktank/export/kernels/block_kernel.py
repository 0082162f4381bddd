"""What a layout's block-product kernel registers (:class:`BlockKernel`): its loop body, how
its workgroups tile the weight rows, the x it takes, and the checks that say whether a shape
fits (:meth:`BlockKernel.refusal`), from which the block product, its custom op, the
manifest's ``cpu_kernels`` and the fit checks are all derived (:mod:`.registry`).

The weight is a layout's blocks as stored, or a plain float16 weight as it is (:mod:`.f16`).
x is float (``f32``, ``bf16``, ``f16``), or 16-bit integers (``i16``, :mod:`.int16_x`, as two
int8 planes) with each group of :data:`GROUP` values' scale and sums as two more operands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ...types.quantized import LAYOUTS, BlockLayout, QuantizedTensor

if TYPE_CHECKING:
    from .mlir import Value
    from .prefill import PrefillWeights
    from .product_dispatch import Block

__all__ = ["BATCH_TILES", "BatchTile", "batch_tile", "BlockKernel", "GROUP", "Int16X", "RESULT_TYPES", "STACK_BYTES", "X_CHUNK_BYTES", "result_type"]

GROUP = 32  # int16 x: values per scale
FLOATS = ("f32", "bf16", "f16")
RESULT_TYPES = FLOATS
ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i16": 2}
X_CHUNK_BYTES = 16384  # the most bytes of x a workgroup's rows read per pass over their blocks
# Scratch (memref.alloca) a dispatch may hold: IREE's CPU backend refuses more than 32 KiB
# of stack per function ("exceeded stack allocation limit"); some margin for its own.
STACK_BYTES = 28 * 1024


@dataclass(frozen=True)
class BatchTile:
    """How a product with several rows of x (a decode batch) holds its sums in registers
    (:func:`batch_tile`): a loop over a weight row's blocks carries the accumulators of
    ``x_rows`` rows of x (the others take loops of their own over the same blocks, then in L1),
    ``weight_rows`` weight rows go side by side (each load of x serving all of them), and an
    accumulator has at most ``lanes`` float32 lanes (a wider product is added a width at a time)."""

    x_rows: int
    weight_rows: int
    lanes: int


# By the width of the vector registers the kernels are written for; float-x kernels only (Q8_0,
# F16, BF16: a block's values formed once in float32, then FMAs with each row's x). AVX2's 16
# registers of 8 lanes: 4 rows x 2 weight rows x one register, 8 accumulators. Before it, each
# of 8 rows carried every accumulator at full width (32 lanes: 32 registers, spilled). On an
# AVX2-only Zen 3 (8 weights of 2048x2048 in turn, 8 rows of x, 3 rounds, two alternations
# with the code before): Q8_0 0.86-0.95 ms a product against 1.28-1.61, bfloat16 0.90-1.07
# against 1.33, float16 0.89-1.04 against 1.32-1.40. The int16-x kernels measured no better
# with it (Q4_K 0.85-0.90 against 0.77-1.02, Q6_K 1.04-1.52 against 0.93-1.10, nor with 4 or
# 8 rows a loop at 8 or 16 lanes), so they keep every row's accumulators in one loop, as AVX512
# does (no entry: not measured on an AVX512 machine since).
BATCH_TILES = {32: BatchTile(x_rows=4, weight_rows=2, lanes=8)}


def batch_tile(int16: bool = False) -> BatchTile | None:
    """The :class:`BatchTile` of the kernels written now (:func:`.isa.current`) with float x, or
    None (``int16``: the int16-x kernels'): every row of x in one loop, accumulators at full
    width."""
    from . import isa

    return None if int16 else BATCH_TILES.get(isa.current().vector_bytes)


@dataclass(frozen=True)
class Int16X:
    """x as 16-bit integers (:mod:`.int16_x`): ``order``, the ``unit``-value pieces of each
    plane as the kernel reads them; ``sum_group``, the values each of x's sums adds up."""

    order: tuple[int, ...]
    sum_group: int = GROUP
    unit: int = GROUP  # values per entry of ``order`` (a divisor of GROUP)

    @property
    def plane(self) -> int:
        """Values per pair of planes (``unit`` per entry of ``order``): 256 for the K-quants'
        super-blocks, 64 for the legacy layouts' pairs of 32-value blocks."""
        return self.unit * len(self.order)


def result_type(elem: str) -> str:
    """The result's element type by default: x's, float32 for int16 x."""
    return "f32" if elem == "i16" else elem


@dataclass(frozen=True)
class BlockKernel:
    """A layout's kernel: ``body(block)`` writes the block loop's body for one weight row
    (:class:`~.product_dispatch.Block`), adding into ``accumulators`` (float32 vectors of those
    lanes, per row of x; the first has ``width`` lanes)."""

    layout_name: str  # as in types.LAYOUTS: "Q4_K" (a plain weight's type: "F16")
    body: Callable[["Block"], None] = field(compare=False)
    rows_per_workgroup: int = 64
    # Weight rows whose block loops run side by side (sharing x's loads) where one row of x is
    # more than X_CHUNK_BYTES, which each weight row would otherwise read from L2.
    rows_at_once: int = 1
    accumulators: tuple[int, ...] = (32,)
    int16: Int16X | None = None  # None: float x
    # Blocks one call of ``body`` takes (the loop steps by this many; K must hold a multiple):
    # 2 lets a 32-value layout fill 64-byte vectors.
    blocks_per_step: int = 1
    # ``values(block)``: one block's values as float32 vectors, ``[(first value, vector), ...]``
    # covering the block in order, for the prefill dispatch (:mod:`.prefill`); None: no prefill kernel.
    values: Callable[["Block"], list[tuple[int, "Value"]]] | None = field(default=None, compare=False)
    # The weight operand: "i8", the layout's blocks [N, K/block_size, block_bytes] (an int8
    # view of the stored bytes); a float type ("f16"), a plain weight [N, K] as it is, taken
    # ``plain_block`` values per block (``layout_name`` then names the type: "F16").
    weight: str = "i8"
    plain_block: int = 32

    def __post_init__(self):
        if self.weight == "i8" and self.layout_name not in LAYOUTS:
            raise ValueError(f"kernel for {self.layout_name}: expected one of the block layouts {sorted(LAYOUTS)}")
        if self.weight != "i8" and self.weight not in FLOATS:
            raise ValueError(f"kernel for {self.layout_name}: expected weights of int8 blocks or of {list(FLOATS)}, found {self.weight}")
        for together in (self.rows_at_once, *(tile.weight_rows for tile in BATCH_TILES.values())):
            if self.rows_per_workgroup % together:
                raise ValueError(f"{self.layout_name} kernel: rows_per_workgroup {self.rows_per_workgroup} is not a multiple of {together} weight rows side by side")

    @property
    def plain(self) -> bool:
        """Whether the weight is plain (float, [N, K]) rather than a layout's blocks."""
        return self.weight != "i8"

    @property
    def layout(self) -> BlockLayout:
        if self.plain:
            raise ValueError(f"the {self.layout_name} kernel's weights are plain {self.weight}, not a block layout")
        return LAYOUTS[self.layout_name]

    def weight_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The weight operand's shape for ``w [n, k]``."""
        return (n, k) if self.plain else (n, k // self.block_size, self.block_bytes)

    def dense(self, w: torch.Tensor) -> torch.Tensor:
        """The weight operand ``w`` (:meth:`weight_shape`) as float32 ``[N, K]``, in torch."""
        if self.plain:
            return w.float()
        n, nb, _ = w.shape
        return QuantizedTensor(self.layout, (n, nb * self.block_size), w.view(torch.uint8)).dequantize(torch.float32)

    @property
    def prefill(self) -> "PrefillWeights | None":
        """The weights as the prefill dispatch reads them (:mod:`.prefill`), or None: no ``values``."""
        if self.values is None:
            return None
        from .prefill import PrefillWeights

        return PrefillWeights(self.name, self.layout_name, self.block_size, self.block_bytes, self.values, self.dense, elem=self.weight)

    @property
    def name(self) -> str:
        """Lower case, as in function names and the manifest: ``q4_k``."""
        return self.layout_name.lower()

    @property
    def block_size(self) -> int:
        return self.plain_block if self.plain else self.layout.block_size

    @property
    def block_bytes(self) -> int:
        return self.plain_block * ELEMENT_BYTES[self.weight] if self.plain else self.layout.block_bytes

    @property
    def width(self) -> int:
        return self.accumulators[0]

    @property
    def elements(self) -> tuple[str, ...]:
        """The x it takes."""
        return ("i16",) if self.int16 else FLOATS

    @property
    def int16_x(self) -> bool:
        return self.int16 is not None

    @property
    def sum_group(self) -> int:
        return self.int16.sum_group if self.int16 else GROUP

    @property
    def function_prefix(self) -> str:
        """What every function name of this kernel starts with."""
        return f"sharktank_{self.name}_product_"

    def function_name(self, m: int, n: int, k: int, elem: str, y: str | None = None, experts: int = 0, pairs: int = 1) -> str:
        """``y``: the result's element type where it is not the default (:func:`result_type`);
        ``experts``: the number of stacked experts the weight operand holds (0: one weight),
        ``pairs``: of (rows, expert) products in the call (``m`` rows each)."""
        suffix = "" if y in (None, result_type(elem)) else f"_to_{y}"
        stacked = (f"e{experts}p{pairs}_" if pairs > 1 else f"e{experts}_") if experts else ""
        return f"{self.function_prefix}{stacked}{m}x{n}x{k}_{elem}{suffix}"

    def rows_together(self, m: int, k: int, elem: str) -> int:
        """Weight rows whose block loops go side by side for x ``[m, k]`` of ``elem``."""
        if m > 1:
            tile = batch_tile(self.int16_x)
            return 1 if tile is None else tile.weight_rows
        return self.rows_at_once if k * ELEMENT_BYTES[elem] >= X_CHUNK_BYTES else 1

    def x_rows_per_pass(self, m: int) -> int:
        """Rows of x whose accumulators one loop over a weight row's blocks carries (the others
        take loops of their own over the same blocks)."""
        tile = batch_tile(self.int16_x)
        return m if tile is None or m == 1 else min(m, tile.x_rows)

    def accumulator_lanes(self, m: int) -> tuple[int, ...]:
        """The float32 lanes of each accumulator for ``m`` rows of x (``accumulators``, or fewer
        where :func:`batch_tile` says so: :meth:`.Block.fma` then adds each of their widths
        of a product in turn)."""
        tile = batch_tile(self.int16_x)
        if tile is None or m == 1:
            return self.accumulators
        return tuple(min(lanes, tile.lanes) for lanes in self.accumulators)

    def refusal(self, m: int, n: int, k: int, elem: str, y: str | None = None) -> str | None:
        """Why the kernel does not take ``x [m, k] @ w[n, k].T`` (x of ``elem``, the result of
        ``y``), or None where it does."""
        what = f"{self.layout_name} kernel"
        y = result_type(elem) if y is None else y
        if elem not in self.elements:
            return f"{what}: activations of type {elem} are not supported; expected one of {list(self.elements)}"
        if y not in RESULT_TYPES:
            return f"{what}: results of type {y} are not supported; expected one of {list(RESULT_TYPES)}"
        step = self.block_size * self.blocks_per_step
        if self.int16:
            step = max(step, self.int16.plane)
        if min(m, n, k) <= 0 or k % step:
            return f"{what}: expected M, N >= 1 and K a multiple of {step}, found M={m}, N={n}, K={k}"
        scratch = 4 * self.rows_per_workgroup * m  # each tile row's result so far, per row of x
        if scratch > STACK_BYTES:
            return f"{what}: x [{m}, {k}] needs {scratch} bytes of scratch, more than the {STACK_BYTES} a dispatch may hold"
        return None
