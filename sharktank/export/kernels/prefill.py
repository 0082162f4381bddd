"""The block product of a prompt (many rows of ``x``, any number: a symbolic length), shared
by every layout that can say what its blocks' values are (:attr:`.BlockKernel.values`): tiles
of the weight dequantized once into bfloat16 on the stack and reused by every row, multiplied
with ``vdpbf16ps`` (AVX512-BF16: 32 products a 512-bit instruction, summed in float32), or on
a CPU with AVX2 and FMA only, each pair split into its two values widened to float32 (a shift,
an and) and two ``vfmadd``s in vdpbf16ps's order: the same products and sums (:mod:`.isa`,
:func:`_rows_avx2`). No
float copy of a whole weight is made: a workgroup holds :data:`TILE_ROWS` weight rows x one
chunk of K (:func:`chunk_values`) at a time.

Operands: ``x`` ``[M, K]`` bfloat16 (M dynamic), the blocks ``[N, K/block_size,
block_bytes]`` int8 as stored, and the result ``y`` ``[M, N]`` float32, which the chunks of K
accumulate into.

Workgroup w takes weight rows ``32 w .. 32 w + 31`` (N a multiple of 32). Per chunk of K it
dequantizes those rows' blocks, 16 rows at a time through a staging buffer (row-major, one
``vector.store`` per 32 values, rounded with ``vcvtne2ps2bf16`` on AVX512-BF16:
:meth:`.Emitter.to_bf16`), into the tile transposed: entry ``[p, r]`` is row r's pair of
values ``2p, 2p + 1`` (bfloat16 pairs as i32, 16x16 transposes of 64 shuffles:
:func:`_transposed`), so that one 64-byte load is
16 weight rows' pairs, the ``vdpbf16ps`` operand whose lanes are weight rows. Then for every 8
rows of x (the last rows of a ragged tail repeat row M - 1, writing the same sums) a register
tile of 8 x 2 accumulators (vector<16xf32>: 8 rows of x x 32 weight rows) runs over the
chunk's pairs: per pair two loads of the tile, eight broadcasts of a pair of x and 16
``vdpbf16ps``. On AVX2 (16 registers of 8 lanes) the register tile is 4 rows of x x 16 weight
rows, the rows' x widened to float32 once per chunk, so that each pair of the tile is widened
once for 4 rows and each x value once for 32 weight rows (:func:`_rows_avx2`). One row of x
(a prompt's last position through the LM head) takes no tile at all (:func:`_one_row`).

Numerics: x and the weights' values rounded to bfloat16 (8 significant bits; at one row the
weights' values stay float32), their products exact and summed in float32: what a bfloat16 model's own products do; for a float32 model each
product moves by about 2^-8 of the sum of its terms' sizes at worst (2e-3 of the largest
value of a random product, the kernel tests' bound).

What the dispatch reads is a :class:`PrefillWeights`: a quantized layout's (its
:class:`.BlockKernel`'s :attr:`~.BlockKernel.prefill`), or a plain float16 weight's
(:data:`.f16.WEIGHTS`: its rows read 32 values at a time).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from . import isa
from .frame import Operand, executable
from .mlir import Emitter, Value, lanes_of, vector
from .product_dispatch import Block

if TYPE_CHECKING:
    import torch

__all__ = ["PrefillWeights", "TILE_ROWS", "chunk_values", "function_name", "function_prefix", "module_asm", "refusal"]


@dataclass(frozen=True)
class PrefillWeights:
    """A weight as the prefill dispatch reads it: blocks of ``block_size`` values in
    ``block_bytes`` bytes (``[N, K/block_size, block_bytes]`` int8), whose ``values(block)``
    are float32 vectors ``[(first value, vector), ...]`` covering the block in order (written
    with :class:`~.product_dispatch.Block`'s loads); ``dense(blocks)``: the weight as float32
    ``[N, K]`` in torch (the custom op's eager form). ``name``: lower case, as in function
    names and the manifest (``q4_k``, ``f16``); ``what``: as messages name it (``Q4_K``)."""

    name: str
    what: str
    block_size: int
    block_bytes: int
    values: Callable[[Block], list[tuple[int, Value]]] = field(compare=False)
    dense: Callable[["torch.Tensor"], "torch.Tensor"] = field(compare=False)
    # The weight operand's element type: "i8", the blocks [N, K/block_size, block_bytes]; a
    # float type ("f16"), the plain weight [N, K] itself (``values`` loads from it at row,
    # block * block_size: no view of other bytes, which IREE would materialize as a copy).
    elem: str = "i8"
    blocks_per_step: int = 1  # Block's loads take the step's first block

    def weight_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The weight operand's shape for ``w [n, k]``."""
        return (n, k) if self.elem != "i8" else (n, k // self.block_size, self.block_bytes)

TILE_ROWS = 32  # weight rows per workgroup: two 16-lane vectors
HALF = 16  # weight rows per staging pass and transpose
# Rows of x of one register tile, by the bf16_dot form (isa.py): 8 x 2 accumulators of 16
# lanes fill AVX512's 32 registers. AVX2's 16 registers of 8 lanes hold 4 rows x 16 weight
# rows (8), the tile's 16 pairs split into odd and even values (4) and a broadcast of x.
X_ROWS = {"avx512_bf16": 8, "avx2": 4}
# Scratch a workgroup holds (a dispatch's stack is 32 KiB): the tile (64 bytes a value
# column: 32 rows of bfloat16), the staging buffer (16 rows of one block) and, for AVX2, the
# register tile's rows of x widened to float32 (16 bytes a value column: 4 rows).
SCRATCH_BYTES = {"avx512_bf16": 26 * 1024, "avx2": 28 * 1024}
X_BYTES = {"avx512_bf16": 0, "avx2": 4 * X_ROWS["avx2"]}


def _stage_bytes(kernel: PrefillWeights) -> int:
    return HALF * kernel.block_size * 2


def chunk_values(kernel: PrefillWeights, k: int) -> int | None:
    """Values of a row per chunk of K: the largest multiple of the block size (and of 32)
    that divides K and fits the tile beside the staging buffer (and the widened x) of the
    host's form (:func:`.isa.current`); None where none does."""
    form = isa.current().bf16_dot or "avx512_bf16"
    most = (SCRATCH_BYTES[form] - _stage_bytes(kernel)) // (2 * TILE_ROWS + X_BYTES[form])
    step = max(kernel.block_size, 32)
    best = None
    for c in range(step, min(k, most) + 1, step):
        if k % c == 0:
            best = c
    return best


def refusal(kernel: PrefillWeights, n: int, k: int) -> str | None:
    """Why the prefill dispatch does not take ``x [M, k] @ w[n, k].T`` for weights read as
    ``kernel``, or None where it does."""
    what = f"{kernel.what} prefill kernel"
    if n <= 0 or n % TILE_ROWS:
        return f"{what}: expected N a multiple of {TILE_ROWS}, found N={n}"
    if k <= 0 or chunk_values(kernel, k) is None:
        return f"{what}: expected K a multiple of {max(kernel.block_size, 32)}, found K={k}"
    return None


def function_prefix(kernel: PrefillWeights) -> str:
    """What every prefill function name of weights read as ``kernel`` starts with."""
    return f"sharktank_{kernel.name}_prefill_"


def function_name(kernel: PrefillWeights, n: int, k: int) -> str:
    return f"{function_prefix(kernel)}{n}x{k}"


@isa.cached
def module_asm(kernel: PrefillWeights, n: int, k: int) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<? x k x bf16>, blocks:
    tensor<n x k/block_size x block_bytes x i8>) -> tensor<? x n x f32>`` and its dispatch,
    for weights read as ``kernel`` (``w``: :meth:`PrefillWeights.weight_shape`).
    ValueError where :func:`refusal` refuses the shape."""
    why = refusal(kernel, n, k)
    if why:
        raise ValueError(why)
    inputs = [Operand("x", (None, k), "bf16"), Operand("w", kernel.weight_shape(n, k), kernel.elem)]
    output = Operand("y", (None, n), "f32")
    return executable(function_name(kernel, n, k), n // TILE_ROWS, inputs, [output], functools.partial(_dispatch, kernel, n, k))


def _dispatch(kernel: PrefillWeights, n: int, k: int, e: Emitter, wg: Value, views: list[Value]) -> None:
    x, w, y = views
    c = e.const
    form = isa.current().bf16_dot
    x_rows = X_ROWS[form]
    v16, b32, i16 = vector(16, "f32"), vector(32, "bf16"), vector(16, "i32")
    bs, kc = kernel.block_size, chunk_values(kernel, k)
    m = e.dim(x, 0, "m")
    last = e.binary("arith.subi", m, c(1), "last")
    first = e.binary("arith.muli", wg, c(TILE_ROWS), "first")
    tile = e.alloca(f"memref<{kc // 2}x{TILE_ROWS}xi32>", "tile")
    stage = e.alloca(f"memref<{HALF}x{bs // 2}xi32>", "stage")
    zero = c(0.0, v16)
    widened = e.alloca(f"memref<2x{x_rows}x{kc // 2}xf32>", "xw") if form == "avx2" else None

    def clear(i: Value, _):
        for half in range(2):
            e.store(zero, y, [i, e.binary("arith.addi", first, c(HALF * half), "col")])

    def chunk(k0: Value, _):
        b0 = e.binary("arith.divui", k0, c(bs), "b0")

        def block(j: Value, _):
            b = e.binary("arith.addi", b0, j, "b")
            p_block = e.binary("arith.muli", j, c(bs // 2), "pb")  # the block's first pair in the tile
            for half in range(2):
                def stage_row(r: Value, _):
                    row = e.binary("arith.addi", first, e.binary("arith.addi", r, c(HALF * half), "r"), "row")
                    blk = Block(e, kernel, {"x": x, "w": w}, row, b, c(0), [], [])
                    for offset, values in kernel.values(blk):
                        pairs = e.to_bf16(values, "wb")
                        words = e.cast("vector.bitcast", pairs, vector(lanes_of(values.type) // 2, "i32"), "ww")
                        e.store(words, stage, [r, c(offset // 2)])

                e.for_(c(0), c(HALF), c(1), stage_row, hint="r")

                def transpose(q: Value, _):  # pairs 16 q .. 16 q + 15 of the 16 staged rows
                    at = e.binary("arith.muli", q, c(16), "q16")
                    rows = [e.load(stage, [c(r), at], i16, "sr") for r in range(HALF)]
                    base = e.binary("arith.addi", p_block, at, "p")
                    for i, col in enumerate(_transposed(e, rows)):
                        e.store(col, tile, [e.binary("arith.addi", base, c(i), "p"), c(HALF * half)])

                e.for_(c(0), c(bs // 32), c(1), transpose, hint="q")

        e.for_(c(0), c(kc // bs), c(1), block, hint="j")
        p0 = e.binary("arith.divui", k0, c(2), "p0")

        def rows_of_x(m0: Value, _):
            rows = [e.binary("arith.minsi", e.binary("arith.addi", m0, c(i), "xr"), last, "xr") for i in range(x_rows)]
            cols = [e.binary("arith.addi", first, c(HALF * half), "col") for half in range(2)]
            inits = [e.load(y, [row, col], v16, "acc") for row in rows for col in cols]

            def pair(p: Value, accs: list[Value]) -> list[Value]:
                ws = [e.cast("vector.bitcast", e.load(tile, [p, c(HALF * half)], i16, "wt"), b32, "wt") for half in range(2)]
                at = e.binary("arith.muli", e.binary("arith.addi", p0, p, "xp"), c(2), "xk")
                out = []
                for i, row in enumerate(rows):
                    xp = e.load(x, [row, at], vector(2, "bf16"), "xp")
                    word = e.extract(e.cast("vector.bitcast", xp, vector(1, "i32"), "xi"), 0, "xi")
                    xb = e.cast("vector.bitcast", e.broadcast(word, i16, "xv"), b32, "xv")
                    for half in range(2):
                        out.append(e.bf16_dot(accs[2 * i + half], ws[half], xb))
                return out

            accs = e.for_(c(0), c(kc // 2), c(1), pair, inits, hint="p")
            for i, row in enumerate(rows):
                for half in range(2):
                    e.store(accs[2 * i + half], y, [row, cols[half]])

        if form == "avx2":
            _rows_avx2(e, x, y, tile, widened, first, last, m, p0, kc)
        else:
            e.for_(c(0), m, c(x_rows), rows_of_x, hint="m0")

    def tiles() -> list:
        e.for_(c(0), m, c(1), clear, hint="m")
        e.for_(c(0), c(k), c(kc), chunk, hint="k0")
        return []

    def one_row() -> list:
        _one_row(e, kernel, x, w, y, first, k)
        return []

    e.if_(e.cmp("arith.cmpi", "eq", m, c(1), "one"), one_row, tiles, [])


def _transposed(e: Emitter, rows: list[Value]) -> list[Value]:
    """The columns of the square whose rows are ``rows`` (n vectors of n lanes, n a power of
    two): n log2(n) two-source shuffles, at each distance d = n/2, ..., 1 the d x d blocks
    off the diagonal of every 2d x 2d block swapped (``vector.transpose`` of a 16x16 vector
    lowers to some 540 instructions; this is 64 ``vpermt2d``-like ones)."""
    n = len(rows)
    d = n // 2
    while d:
        out = list(rows)
        for i in range(n):
            if i & d:
                continue
            top, bottom = rows[i], rows[i + d]
            out[i] = e.shuffle(top, bottom, [c if not c & d else n + c - d for c in range(n)], "tr")
            out[i + d] = e.shuffle(top, bottom, [c + d if not c & d else n + c for c in range(n)], "tr")
        rows = out
        d //= 2
    return rows


def _one_row(e: Emitter, kernel: PrefillWeights, x: Value, w: Value, y: Value, first: Value, k: int) -> None:
    """One row of x (a prompt's last position through the LM head, one token of a chunk): no
    tile, whose building would cost more than the product, and no register tile of rows
    that would repeat the one row (SmolLM2's 49152x576 Q8_0 LM head on a Zen 3, 2 threads:
    2.4-3.4 ms against 10.4-11.5 ms through the tiles). Per weight row, per block, its values
    as float32 (not rounded to bfloat16: closer to the exact product than the tiles) times x's
    widened values, 16 lanes a ``vfmadd``; the row's sum is the lanes' at its end."""
    c = e.const
    v16, bs = vector(16, "f32"), kernel.block_size

    def weight_row(r: Value, _):
        row = e.binary("arith.addi", first, r, "row")

        def block(b: Value, accs: list[Value]) -> list[Value]:
            (acc,) = accs
            blk = Block(e, kernel, {"x": x, "w": w}, row, b, c(0), [], [])
            base = e.binary("arith.muli", b, c(bs), "kb")
            for offset, values in kernel.values(blk):
                lanes = lanes_of(values.type)
                if lanes % 16:
                    raise ValueError(f"{kernel.what} prefill kernel: values of 16 lanes or multiples expected, found {values.type}")
                xv = e.widen_bf16(e.load(x, [c(0), e.binary("arith.addi", base, c(offset), "kx")], vector(lanes, "bf16"), "xb"))
                for at in range(0, lanes, 16):
                    acc = e.fma(e.slice(values, at, 16, "ws"), e.slice(xv, at, 16, "xs"), acc)
            return [acc]

        (acc,) = e.for_(c(0), c(k // bs), c(1), block, [c(0.0, v16)], hint="b")
        e.store_scalar(e.reduction("add", acc), y, [c(0), row])

    e.for_(c(0), c(TILE_ROWS), c(1), weight_row, hint="r")


def _rows_avx2(e: Emitter, x: Value, y: Value, tile: Value, widened: Value, first: Value, last: Value, m: Value, p0: Value, kc: int) -> None:
    """The chunk's products on AVX2 (:data:`X_ROWS` rows of x at a time): each row's pairs
    of x widened to float32 once into ``widened`` (``[0, i, p]``: row i's odd value of pair
    p, ``[1, i, p]`` its even one), then per 16 weight rows a register tile of 4 x 16
    accumulators over the pairs: one load of the tile's 16 pairs, their odd and even values
    (an and, a shift: what :meth:`.Emitter.bf16_dot` does, once for the 4 rows), and per row
    two broadcasts and two ``vfmadd``s, odd then even: the sums of ``bf16_dot``, bit for bit."""
    c = e.const
    x_rows = X_ROWS["avx2"]
    v16, i16 = vector(16, "f32"), vector(16, "i32")

    def rows_of_x(m0: Value, _):
        rows = [e.binary("arith.minsi", e.binary("arith.addi", m0, c(i), "xr"), last, "xr") for i in range(x_rows)]

        def widen(q: Value, _):  # pairs 16 q .. 16 q + 15 of the chunk, each row
            at = e.binary("arith.muli", e.binary("arith.addi", p0, e.binary("arith.muli", q, c(16), "q16"), "xp"), c(2), "xk")
            for i, row in enumerate(rows):
                words = e.cast("vector.bitcast", e.load(x, [row, at], vector(32, "bf16"), "xb"), i16, "xw")
                for parity, values in enumerate(e.bf16_pairs(words)):
                    e.store(values, widened, [c(parity), c(i), e.binary("arith.muli", q, c(16), "q16")])

        e.for_(c(0), c(kc // 32), c(1), widen, hint="q")
        for half in range(2):
            col = e.binary("arith.addi", first, c(HALF * half), "col")
            inits = [e.load(y, [row, col], v16, "acc") for row in rows]

            def pair(p: Value, accs: list[Value]) -> list[Value]:
                w_odd, w_even = e.bf16_pairs(e.load(tile, [p, c(HALF * half)], i16, "wt"))
                out = []
                for i, acc in enumerate(accs):
                    x_odd, x_even = (e.broadcast(e.load_scalar(widened, [c(parity), c(i), p], "xs"), v16, "xv") for parity in range(2))
                    out.append(e.fma(w_even, x_even, e.fma(w_odd, x_odd, acc)))
                return out

            accs = e.for_(c(0), c(kc // 2), c(1), pair, inits, hint="p")
            for row, acc in zip(rows, accs):
                e.store(acc, y, [row, col])

    e.for_(c(0), m, c(x_rows), rows_of_x, hint="m0")
