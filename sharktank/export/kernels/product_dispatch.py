"""The block product's dispatch, shared by every layout: workgroups take a tile of
``rows_per_workgroup`` weight rows each (the last one the remainder), a loop over a row's
blocks carries float32 accumulator vectors per row of ``x``, then the per-row sums and
stores. A layout (:mod:`.registry`) writes only the loop's body, how one block's bytes become
products (:class:`Block`), as a Python function: where several weight rows go at once, the
frame calls it once per row.

Where ``x`` is larger than :data:`X_CHUNK_BYTES` (8 rows of 2048 float32 are 64 KiB), the
rows walk their blocks in passes over that much of ``x``, so that it stays in L1 while the
tile's rows read it; each pass's sums are added to the rows' results. An 8192x2048 Q4_K
product with 8 rows took 2.4-2.9 ms so against 3.1-3.2 ms in one pass. A single row of
``x`` always goes in one pass, and where it is larger than that (ffn_down's K=8192: 32 KiB,
all of a Zen4 core's L1) a kernel's ``rows_at_once`` weight rows walk their blocks side by
side, each load of ``x`` serving all of them: with the weights read from memory (8 weights
of 2048x8192 in turn, interleaved rounds), Q8_0 took 0.82 ms a product with 4 rows at once
against 1.31 ms, and the float32-x forms of Q4_K and Q6_K 0.74 against 0.96 ms and 1.14
against 1.35 ms with 2. Their int16-x forms (two bytes a value) take 2 from 16 KiB: Q4_K
2048x8192 0.56 against 0.69 ms. With K=2048 it made no difference (or was a little slower),
and with 8 rows of x it was slower.

Several rows of x (a decode batch) go as :func:`.block_kernel.batch_tile` says: on AVX2, for
the float-x kernels, 4 rows of x and 2 weight rows a loop over the blocks, accumulators of 8
lanes (a register each), the other rows in loops of their own over the same blocks (then in L1).
"""

from __future__ import annotations

import functools

from . import isa
from .block_kernel import ELEMENT_BYTES, GROUP, X_CHUNK_BYTES, BlockKernel, result_type
from .frame import Operand, executable, memref_type
from .mlir import Emitter, Value, elem_of, lanes_of, vector

__all__ = ["Block", "module_asm"]


class Block:
    """What a layout's loop body writes with, for one weight row: the emitter ``e``, the
    weight memref ``w`` indexed ``[row, b, byte]`` (a plain weight's: ``[row, value]``,
    :meth:`plain`), the value column ``k`` where block ``b``
    starts, x's rows ``rows`` (index constants), and the accumulators; with int16 x (``x``:
    its int8 planes) also ``xd``, its groups' scales, and ``xs``, its sums of every
    ``kernel.sum_group`` values."""

    def __init__(self, e: Emitter, kernel: BlockKernel, operands: dict[str, Value], row: Value, b: Value, k: Value, rows: list[Value], accs: list[list[Value]]):
        self.e, self.kernel, self.row, self.b, self.k, self.rows = e, kernel, row, b, k, rows
        self.x, self.w = operands["x"], operands["w"]
        self.xd, self.xs = operands.get("xd"), operands.get("xs")
        self.current = [list(row_accs) for row_accs in accs]  # per row of x, per accumulator
        self.m = len(rows)
        self._k2: Value | None = None

    @property
    def acc(self) -> str:
        """The first accumulator's type (``kernel.width`` float32 lanes)."""
        return vector(self.kernel.width, "f32")

    def _block(self, block: int) -> Value:
        """The index of the step's block ``block`` (0 .. ``kernel.blocks_per_step`` - 1)."""
        if not 0 <= block < self.kernel.blocks_per_step:
            raise ValueError(f"block {block} of a step of {self.kernel.blocks_per_step}")
        return self.b if block == 0 else self.e.binary("arith.addi", self.b, self.e.const(block), "bn")

    def byte(self, offset: int, lanes: int, hint: str = "q", block: int = 0) -> Value:
        """The ``lanes`` bytes (``vector<lanes x i8>``) at ``offset`` of the step's block ``block``."""
        return self.e.load(self.w, [self.row, self._block(block), self.e.const(offset)], vector(lanes, "i8"), hint)

    def halves(self, offset: int, count: int = 1, block: int = 0) -> list[Value]:
        """The ``count`` float16 numbers at ``offset`` of the step's block ``block``, as float32 scalars."""
        f = self.half_vector(offset, count, block)
        return [self.e.extract(f, i, "d") for i in range(count)]

    def plain(self, lanes: int, hint: str = "w") -> Value:
        """A plain weight's (:attr:`.BlockKernel.plain`) ``lanes`` values from the block's
        first, widened to float32 (``vector<lanes x f32>``)."""
        e = self.e
        col = e.binary("arith.muli", self.b, e.const(self.kernel.block_size), "col")
        elem = elem_of(self.w.type)
        got = e.load(self.w, [self.row, col], vector(lanes, elem), hint)
        if elem == "bf16":
            return e.widen_bf16(got, hint)
        return got if elem == "f32" else e.cast("arith.extf", got, vector(lanes, "f32"), hint)

    def half_vector(self, offset: int, count: int, block: int = 0) -> Value:
        """(vector<count x f32>) the ``count`` float16 numbers at ``offset`` of the step's block ``block``."""
        e = self.e
        raw = self.byte(offset, 2 * count, "hb", block)
        h = e.cast("vector.bitcast", raw, vector(count, "f16"), "h")
        return e.cast("arith.extf", h, vector(count, "f32"), "hf")

    def prefetch(self, ahead: int) -> None:
        """Prefetch the block ``ahead`` blocks on (past a row's end: the next row's). The
        hardware's own prefetching left these loops waiting on memory: the 1B Q4_K mix decoded
        at 38.7 ms/token with it in the Q4_K and Q6_K kernels against 43.0 without (7 paired
        rounds). In Q8_0's it made the whole decode slower, so that kernel has none."""
        e = self.e
        later = e.binary("arith.addi", self.b, e.const(ahead), "pf")
        for at in range(0, self.kernel.block_bytes, 64):
            e.prefetch(self.w, [self.row, later, e.const(at)])

    def fma(self, i: int, a: Value, b: Value, slot: int = 0) -> None:
        """Row ``i``'s accumulator ``slot`` += ``a * b`` (where the accumulator has fewer lanes
        than ``a``: each of its widths of ``a * b`` in turn)."""
        acc = self.current[i][slot]
        lanes, wide = lanes_of(acc.type), lanes_of(a.type)
        if lanes == wide:
            self.current[i][slot] = self.e.fma(a, b, acc)
            return
        for at in range(0, wide, lanes):
            acc = self.e.fma(self.e.slice(a, at, lanes, "a"), self.e.slice(b, at, lanes, "b"), acc)
        self.current[i][slot] = acc

    def load_x(self, i: int, column: int, lanes: int) -> Value:
        """float32 ``x[i, k + column : + lanes]``."""
        e = self.e
        col = e.binary("arith.addi", self.k, e.const(column), "col")
        elem = elem_of(self.x.type)
        got = e.load(self.x, [self.rows[i], col], vector(lanes, elem), "x")
        return got if elem == "f32" else e.cast("arith.extf", got, vector(lanes, "f32"), "x")

    def accumulate(self, values: Value, column: int) -> None:
        """Every row's accumulator += ``values`` (``acc`` type) times ``x[i, k + column : + width]``."""
        for i in range(self.m):
            self.fma(i, values, self.load_x(i, column, self.kernel.width))

    def x16_dot(self, i: int, unsigned: Value, at: int) -> Value:
        """(vector<16xf32>) the exact integer products of the 64 ``unsigned`` bytes with int16
        x's 64 values from ``at`` in the plane (row ``i``), summed in groups of 4 (lane j:
        values 4j..4j+3): ``256 * dot(u, high) + dot(u, low)``, two ``vpdpbusd``. The planes
        of each ``plane`` values (:attr:`.Int16X.plane`): its high bytes, then its low ones;
        the step's first value ``k`` starts a plane."""
        e, v64 = self.e, vector(64, "i8")
        if self._k2 is None:
            self._k2 = e.binary("arith.addi", self.k, self.k, "k2")
        high_at = e.binary("arith.addi", self._k2, e.const(at), "col")
        high = e.load(self.x, [self.rows[i], high_at], v64, "xh")
        low_at = e.binary("arith.addi", self._k2, e.const(self.kernel.int16.plane + at), "col")
        low = e.load(self.x, [self.rows[i], low_at], v64, "xl")
        dh = e.int8_dot(e.const(0, vector(16, "i32")), unsigned, high, "dh", weight=256)
        dot = e.int8_dot(dh, unsigned, low, "dot")
        return e.cast("arith.sitofp", dot, vector(16, "f32"), "dot")

    def scales_of_16(self, s: Value, o: Value) -> list[Value]:
        """For a super-block of 16 scales of 16 values (Q3_K, Q6_K; vector<16xf32> ``s``, the
        weight scale of each 16 values, and ``o``, what each 16's offset costs a unit of x):
        adds ``o`` times x's sums of 16 (accumulator 1) to every row's and returns, per row
        of x, ``s`` times x's group scale of each 16 values."""
        e, v16 = self.e, vector(16, "f32")
        b8 = e.binary("arith.muli", self.b, e.const(8), "b8")
        b16 = e.binary("arith.muli", self.b, e.const(16), "b16")
        pairs = [j // 2 for j in range(16)]  # x's group scale of each 16 values
        scaled = []
        for i in range(self.m):
            self.fma(i, o, e.load(self.xs, [self.rows[i], b16], v16, "xs"), 1)
            xd = e.load(self.xd, [self.rows[i], b8], vector(8, "f32"), "xd")
            scaled.append(e.binary("arith.mulf", s, e.shuffle(xd, xd, pairs, "xd"), "sx"))
        return scaled

    def x16_accumulate(self, i: int, unsigned: Value, at: int, scales: Value, picks: list[int], slot: int = 0) -> None:
        """Row ``i``'s accumulator ``slot`` (16 lanes) += :meth:`x16_dot` times ``scales``,
        lane j taking ``scales[picks[j]]``."""
        dot = self.x16_dot(i, unsigned, at)
        self.fma(i, dot, self.e.shuffle(scales, scales, picks, "sv"), slot)


def _operands(kernel: BlockKernel, m: int, n: int, k: int, elem: str, y: str, experts: int = 0, pairs: int = 1) -> tuple[list[Operand], Operand]:
    r = m * pairs  # x's rows: m per pair
    x = Operand("x", (r, 2 * k), "i8") if elem == "i16" else Operand("x", (r, k), elem)  # int16 x: its two int8 planes
    groups = [Operand("xd", (r, k // GROUP), "f32"), Operand("xs", (r, k // kernel.sum_group), "f32")] if elem == "i16" else []
    if experts:  # the stacked experts' weights and the index of each pair's expert
        weights = [Operand("ei", (pairs,), "i64"), Operand("we", (experts, *kernel.weight_shape(n, k)), kernel.weight)]
    else:
        weights = [Operand("w", kernel.weight_shape(n, k), kernel.weight)]
    return [x, *groups, *weights], Operand("y", (r, n), y)


# Cached: the custom op builds a shape's module once per trace that takes it.
@isa.cached
def module_asm(kernel: BlockKernel, m: int, n: int, k: int, elem: str, y: str | None = None, experts: int = 0, pairs: int = 1) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>, blocks:
    tensor<n x k/block_size x block_bytes x i8>) -> tensor<m x n x y>`` and its dispatch.
    With ``elem`` "i16" the function takes ``(planes: tensor<m x 2k x i8>, scales: tensor<m x
    k/GROUP x f32>, sums: tensor<m x k/sum_group x f32>, blocks)``. ``y``: the result's element
    type (f32, bf16 or f16; by default :func:`result_type`): the sums are float32 and rounded
    once to it as they are stored, so that a half-precision model needs no conversion
    dispatch after each product. ValueError where the kernel refuses the shape.

    ``experts`` > 0: the weight operand is replaced by two, ``expert: tensor<pairs x i64>``
    and the stacked weights of that many experts (``tensor<experts x ...>``, each one
    ``blocks``' shape); x and the result have ``pairs * m`` rows, and pair ``p``'s ``m`` rows
    are multiplied by expert ``expert[p]``'s weight, read in place (a subview at that offset,
    which the caller keeps in range), ``pairs`` times as many workgroups in one dispatch. A
    slice at a data offset passed to the plain form was copied into a buffer of its own first
    (IREE's ``slow_memcpy`` dispatch): a decode step's expert read its weight three times
    (read, write, read); and one dispatch per pair cost each pair a dispatch's overhead
    (Qwen3-MoE's top 8: 96 product dispatches a step in 4 layers)."""
    y = result_type(elem) if y is None else y
    refusal = kernel.refusal(m, n, k, elem, y)
    if refusal:
        raise ValueError(refusal)
    if pairs < 1 or (pairs > 1 and not experts):
        raise ValueError(f"{kernel.layout_name} kernel: {pairs} pairs of x rows and experts need stacked experts (experts > 0)")
    inputs, output = _operands(kernel, m, n, k, elem, y, experts, pairs)
    tiles = -(-n // kernel.rows_per_workgroup)
    body = functools.partial(_dispatch, kernel, m, n, k, elem, [*inputs, output], tiles)
    return executable(kernel.function_name(m, n, k, elem, y, experts, pairs), tiles * pairs, inputs, [output], body)


def _rows_of_pair(e: Emitter, view: Value, op: Operand, first: Value, m: int) -> Value:
    """Rows ``first .. first + m`` of the 2-D operand ``op`` (its memref ``view``), a subview in place."""
    cols = op.shape[1]
    rows = memref_type((m, cols), op.elem)
    return e.assign(op.hint, f"memref.subview {view}[{first}, 0] [{m}, {cols}] [1, 1] : {view.type} to {rows}", rows)


def _expert_weight(e: Emitter, kernel: BlockKernel, n: int, k: int, index: Value, stacked: Value, pair: Value) -> Value:
    """The weight of expert ``index[pair]`` of ``stacked``, a rank-reduced subview in place."""
    shape = kernel.weight_shape(n, k)
    at = e.cast("arith.index_cast", e.load_scalar(index, [pair], "ei"), "index", "ei")
    zeros = ", ".join(["0"] * len(shape))
    sizes = ", ".join(map(str, (1, *shape)))
    ones = ", ".join(["1"] * (len(shape) + 1))
    one = memref_type(shape, kernel.weight)
    return e.assign("w", f"memref.subview {stacked}[{at}, {zeros}] [{sizes}] [{ones}] : {stacked.type} to {one}", one)


def _dispatch(kernel: BlockKernel, m: int, n: int, k: int, elem: str, ops: list[Operand], tiles: int, e: Emitter, wg: Value, views: list[Value]) -> None:
    operands = {op.hint: view for op, view in zip(ops, views)}
    if "we" in operands:
        # Stacked experts: workgroup wg takes tile wg % tiles of pair wg / tiles's product,
        # whose rows of x and of the result, and whose expert's weight, are subviews.
        index, stacked = operands.pop("ei"), operands.pop("we")
        pairs = next(op.shape[0] for op in ops if op.hint == "ei")
        pair = e.const(0)
        if pairs > 1:
            pair = e.binary("arith.divui", wg, e.const(tiles), "pair")
            wg = e.binary("arith.remui", wg, e.const(tiles), "wg")
            first_row = e.binary("arith.muli", pair, e.const(m), "prow")
            for op in ops:
                if op.hint in ("x", "xd", "xs", "y"):
                    operands[op.hint] = _rows_of_pair(e, operands[op.hint], op, first_row, m)
        operands["w"] = _expert_weight(e, kernel, n, k, index, stacked, pair)
    t, nb, slots = kernel.rows_per_workgroup, k // kernel.block_size, len(kernel.accumulators)
    together = kernel.rows_together(m, k, elem)
    c = e.const
    rows = [c(i) for i in range(m)]
    per_pass = kernel.x_rows_per_pass(m)
    groups = [rows[g : g + per_pass] for g in range(0, m, per_pass)]
    zeros = [c(0.0, vector(lanes, "f32")) for lanes in kernel.accumulator_lanes(m)]
    first = e.binary("arith.muli", wg, c(t), "first")
    left = e.binary("arith.subi", c(n), first, "left")
    count = e.binary("arith.minsi", c(t), left, "count")
    parts = e.binary("arith.minsi", count, c(t // together), "parts")
    sums_t = f"memref<{t}x{m}xf32>"
    sums = e.alloca(sums_t, "sums")  # each tile row's result so far, per row of x
    fz = c(0.0, "f32")

    def zero(i: Value, _):
        for r in rows:
            e.store_scalar(fz, sums, [i, r])

    e.for_(c(0), count, c(1), zero)
    # Rows of x are read once per weight row: in chunks of blocks whose x fits in L1 (each
    # weight row's partial sums kept in sums), not all of K, when x is large (M=8: 64 KiB).
    # One row of x goes in one pass: a 2048x8192 Q8_0 product took 1.02 ms so against 1.25 ms
    # in passes of 16 KiB (interleaved rounds), the weight rows then read in one stream each.
    step = kernel.blocks_per_step  # blocks per body call; nb is a multiple (refusal)
    blocks = nb if m == 1 else max(1, X_CHUNK_BYTES // (m * kernel.block_size * ELEMENT_BYTES[elem]))
    chunk = c(max(step, blocks // step * step))

    def tile_rows(i: Value) -> tuple[list[Value], list[Value]]:
        # The tile's rows go `together` at a time, copy r taking the r-th of as many equal
        # parts of the tile, so that each copy's weight rows are one stream: rows next to each
        # other made short streams (each weight row's few KiB), and 8192x2048 products 2x slower.
        # Where the last tile has fewer rows, a copy past them reads the last row again (its sums
        # land in scratch rows no store reads).
        at, weight_rows = [], []
        for r in range(together):
            at.append(e.binary("arith.addi", i, c(r * (t // together)), "at"))
            row = e.binary("arith.addi", first, at[-1], "row")
            weight_rows.append(e.binary("arith.minsi", row, c(n - 1), "row"))
        return at, weight_rows

    def chunk_pass(b0: Value, _):
        end = e.binary("arith.addi", b0, chunk, "b1")
        b1 = e.binary("arith.minsi", end, c(nb), "b1")

        def tile_part(i: Value, _):
            at, weight_rows = tile_rows(i)
            for group in groups:  # each its own loop over the chunk's blocks (rereading them from L1)
                group_part(at, weight_rows, group)

        def group_part(at: list[Value], weight_rows: list[Value], group: list[Value]) -> None:
            g = len(group)
            inits = [zeros[s] for _ in range(together) for _ in range(g) for s in range(slots)]

            def block_loop(b: Value, carried: list[Value]) -> list[Value]:
                kcol = e.binary("arith.muli", b, c(kernel.block_size), "k")
                out = []
                for r in range(together):
                    mine = carried[r * g * slots : (r + 1) * g * slots]
                    blk = Block(e, kernel, operands, weight_rows[r], b, kcol, group, [mine[j * slots : (j + 1) * slots] for j in range(g)])
                    kernel.body(blk)
                    out += [v for row_accs in blk.current for v in row_accs]
                return out

            accs = e.for_(b0, b1, c(step), block_loop, inits, hint="b")
            for r in range(together):
                for j in range(g):
                    total = None
                    for s in range(slots):
                        part = e.reduction("add", accs[(r * g + j) * slots + s], "s")
                        total = part if total is None else e.binary("arith.addf", total, part, "s")
                    old = e.load_scalar(sums, [at[r], group[j]], "old")
                    e.store_scalar(e.binary("arith.addf", old, total, "new"), sums, [at[r], group[j]])

        e.for_(c(0), parts, c(1), tile_part)

    e.for_(c(0), c(nb), chunk, chunk_pass, hint="b0")

    def store(i: Value, _):
        row = e.binary("arith.addi", first, i, "row")
        y = operands["y"]
        y_elem = elem_of(y.type)
        for r in rows:
            got = e.load_scalar(sums, [i, r], "y")
            if y_elem != "f32":
                got = e.cast("arith.truncf", got, y_elem, "y")
            e.store_scalar(got, y, [r, row])

    e.for_(c(0), count, c(1), store)
