"""The frame every block-product kernel shares: a ``stream.executable`` whose workgroups take
a tile of weight rows each (the last one the remainder), a loop over a row's blocks carrying
float32 accumulator vectors per row of ``x``, the per-row sums and stores, and the
``util.func`` that dispatches it. A layout's module (:mod:`.q8_0`, :mod:`.q4_k`, :mod:`.q6_k`)
writes only the body of the block loop, how its bytes become products (:class:`Block`). The
x a kernel takes is float (``f32``, ``bf16``, ``f16``), or 16-bit integers (``i16``, as two
int8 planes) with each group of :data:`GROUP` values' scale and sum as two more operands
(:mod:`.int16_x`).

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

Bindings are memrefs with ``offset: ?`` strided layouts: stream packs bindings at offsets
in one buffer, and a plain identity memref would read from the buffer's start (a segfault).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable

__all__ = ["Block", "Kernel", "module_asm", "result_type"]

# x's element types and their bytes. "i16": x quantized to 16 bits per GROUP values and split
# into two int8 planes (int16_x: a tensor [m, 2k] of int8), the kernel also taking each group's
# scale and sums, float32, and returning float32 y.
GROUP = 32
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i16": 2}
X_CHUNK_BYTES = 16384  # the most bytes of x a workgroup's rows read per pass over their blocks
# Scratch (memref.alloca) a dispatch may hold: IREE's CPU backend refuses more than 32 KiB
# of stack per function ("exceeded stack allocation limit"); some margin for its own.
STACK_BYTES = 28 * 1024


def int8_dot(name: str, acc: str, unsigned: str, signed: str) -> str:
    """``name = `` ``vpdpbusd`` (AVX512-VNNI): ``acc`` (vector<16xi32>) plus, in lane i, the
    sum of the products of bytes 4i..4i+3 of ``unsigned`` (vector<64xi8> read as uint8) and
    ``signed`` (int8). An LLVM intrinsic call: MLIR's x86vector dialect is not in IREE's
    compiler."""
    return (f'{name} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"({acc}, {unsigned}, {signed}) : '
            "(vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>")


@dataclass(frozen=True)
class Kernel:
    """A layout's block geometry and how its workgroups tile the rows."""

    layout: str  # lower case, as in the function names: "q4_k"
    block_size: int  # values per block
    block_bytes: int
    rows_per_workgroup: int
    width: int = 32  # lanes of an accumulator
    # Weight rows whose block loops run side by side (sharing x's loads) where one row of x is
    # more than X_CHUNK_BYTES, which each weight row would otherwise read from L2.
    rows_at_once: int = 1
    elements: tuple[str, ...] = ("f32", "bf16", "f16")  # the x it takes (keys of _BYTES)
    sum_group: int = GROUP  # int16 x: the values each of its sums (%xs) adds up

    def __post_init__(self):
        if self.rows_per_workgroup % self.rows_at_once:
            raise ValueError(f"{self.layout}: rows_per_workgroup {self.rows_per_workgroup} is not a multiple of rows_at_once {self.rows_at_once}")

    @property
    def int16_x(self) -> bool:
        """Whether it takes x as 16-bit integers (int16_x) rather than float."""
        return self.elements == ("i16",)

    def function_name(self, m: int, n: int, k: int, elem: str, y: str | None = None) -> str:
        """``y``: the result's element type where it is not the default (:func:`result_type`)."""
        suffix = "" if y in (None, result_type(elem)) else f"_to_{y}"
        return f"sharktank_{self.layout}_product_{m}x{n}x{k}_{elem}{suffix}"


def result_type(elem: str) -> str:
    """The result's element type by default: x's, float32 for int16 x."""
    return "f32" if elem == "i16" else elem


class Block:
    """What a layout's loop body writes with: the weight memref ``%w`` indexed ``[%row, %b,
    byte]``, the value column ``%k`` where block ``%b`` starts, and the rows' accumulators;
    with int16 x (``%x``: its int8 planes) also ``%xd`` (``group_t``), its groups' scales, and
    ``%xs`` (``sums_t``), its sums of every ``kernel.sum_group`` values."""

    def __init__(self, kernel: Kernel, m: int, k: int, elem: str, x_t: str, w_t: str, group_t: str, sums_t: str):
        self.kernel, self.m, self.k, self.elem, self.x_t, self.w_t = kernel, m, k, elem, x_t, w_t
        self.group_t, self.sums_t = group_t, sums_t  # int16 x: the types of %xd (scales) and %xs (sums)
        self.acc = f"vector<{kernel.width}xf32>"
        self.types = [self.acc]  # per row: the accumulators' types (slot 0: ``acc``)
        self.current = [[f"%a{i}_0"] for i in range(m)]  # per row, per slot: its value so far
        self._x16_constants = False  # whether x16_dot has written its constants yet

    def add_accumulator(self, type_: str) -> int:
        """A further float32 vector accumulator per row (summed into the row's result); its slot."""
        self.types.append(type_)
        for i, row in enumerate(self.current):
            row.append(f"%a{i}_{len(self.types) - 1}")
        return len(self.types) - 1

    def byte(self, offset: int, lanes: int, name: str) -> str:
        """``name = `` the ``lanes`` bytes (``vector<lanes x i8>``) at ``offset`` of the block."""
        return f"%{name}_at = arith.constant {offset} : index\n%{name} = vector.load %w[%row, %b, %{name}_at] : {self.w_t}, vector<{lanes}xi8>"

    def prefetch(self, ahead: int) -> str:
        """Lines prefetching the block ``ahead`` blocks on (past a row's end: the next row's).
        The hardware's own prefetching left these loops waiting on memory: the 1B Q4_K mix decoded
        at 38.7 ms/token with it in the Q4_K and Q6_K kernels against 43.0 without (7 paired
        rounds). In Q8_0's it made the whole decode slower, so that kernel has none."""
        lines = [f"%pf_ahead = arith.constant {ahead} : index", "%pf_b = arith.addi %b, %pf_ahead : index"]
        for at in range(0, self.kernel.block_bytes, 64):
            lines += [f"%pf_{at} = arith.constant {at} : index", f"memref.prefetch %w[%row, %pf_b, %pf_{at}], read, locality<3>, data : {self.w_t}"]
        return "\n".join(lines)

    def x16_dot(self, i: int, unsigned: str, at: int, tag: str) -> str:
        """``%dotf{tag} = `` (vector<16xf32>) the exact integer products of the 64 ``unsigned``
        bytes with int16 x's 64 values from ``at`` in the super-block (row ``i``), summed in
        groups of 4 (lane j: values 4j..4j+3): ``256 * dot(u, high) + dot(u, low)``, two
        ``vpdpbusd``. The first call also writes the constants they use, and ``%k2``, the
        column of the super-block's planes (256 high bytes, then 256 low, per 256 values)."""
        v64, t = "vector<64xi8>", tag
        lines = []
        if not self._x16_constants:
            self._x16_constants = True
            lines += ["%iz = arith.constant dense<0> : vector<16xi32>", "%i8 = arith.constant dense<8> : vector<16xi32>", "%k2 = arith.addi %k, %k : index"]
        return "\n".join([
            *lines,
            f"%xh{t}_at = arith.constant {at} : index",
            f"%xh{t}_col = arith.addi %k2, %xh{t}_at : index",
            f"%xh{t} = vector.load %x[%r{i}, %xh{t}_col] : {self.x_t}, {v64}",
            f"%xl{t}_at = arith.constant {256 + at} : index",
            f"%xl{t}_col = arith.addi %k2, %xl{t}_at : index",
            f"%xl{t} = vector.load %x[%r{i}, %xl{t}_col] : {self.x_t}, {v64}",
            int8_dot(f"%dh{t}", "%iz", unsigned, f"%xh{t}"),
            f"%dh8{t} = arith.shli %dh{t}, %i8 : vector<16xi32>",
            int8_dot(f"%dot{t}", f"%dh8{t}", unsigned, f"%xl{t}"),
            f"%dotf{t} = arith.sitofp %dot{t} : vector<16xi32> to vector<16xf32>",
        ])

    def x16_accumulate(self, i: int, unsigned: str, at: int, scales: str, lanes: int, picks: list[int], tag: str) -> str:
        """Row ``i``'s accumulator (16 lanes) += :meth:`x16_dot` times ``scales`` (``vector<lanes
        x f32>``), lane j taking ``scales[picks[j]]``."""
        t = f"vector<{lanes}xf32>"
        return "\n".join([
            self.x16_dot(i, unsigned, at, tag),
            f"%sv{tag} = vector.shuffle {scales}, {scales} [{', '.join(map(str, picks))}] : {t}, {t}",
            self.fma(i, f"%dotf{tag}", f"%sv{tag}", tag=f"d{tag}"),
        ])

    def load_x(self, i: int, column: int, lanes: int, name: str) -> str:
        """``name = `` float32 ``x[i, k + column : + lanes]``."""
        lines = [f"%{name}_at = arith.constant {column} : index", f"%{name}_col = arith.addi %k, %{name}_at : index"]
        load = f"vector.load %x[%r{i}, %{name}_col] : {self.x_t}, vector<{lanes}x{self.elem}>"
        if self.elem == "f32":
            return "\n".join([*lines, f"%{name} = {load}"])
        return "\n".join([*lines, f"%{name}_e = {load}", f"%{name} = arith.extf %{name}_e : vector<{lanes}x{self.elem}> to vector<{lanes}xf32>"])

    def fma(self, i: int, a: str, b: str, slot: int = 0, tag: str = "") -> str:
        """Row ``i``'s accumulator ``slot`` += ``a * b``."""
        name = f"%u{tag}_{i}_{slot}"
        line = f"{name} = vector.fma {a}, {b}, {self.current[i][slot]} : {self.types[slot]}"
        self.current[i][slot] = name
        return line

    def accumulate(self, values: str, column: int, tag: str) -> str:
        """Lines adding ``values`` (``acc`` type) times ``x[i, k + column : + width]`` to row i's
        accumulator, for every row ``i``."""
        lines = []
        for i in range(self.m):
            lines += [self.load_x(i, column, self.kernel.width, f"x{tag}_{i}"), self.fma(i, values, f"%x{tag}_{i}", tag=tag)]
        return "\n".join(lines)


_DEFINED = re.compile(r"^\s*(%[A-Za-z_]\w*)(?::\d+)?\s*=", re.MULTILINE)
_NAME = re.compile(r"%[A-Za-z_]\w*")


def _row_copy(body: str, block: Block, r: int) -> tuple[str, list[str]]:
    """The block loop's body for weight row ``%row{r}`` of the rows that go at once: every
    value it defines and the accumulators it starts from get the suffix ``_r{r}`` (loads of
    ``x`` are then the same in every copy, and the compiler reads them once); also the
    names of the copy's accumulators at its end, per row of ``x`` and slot."""
    rename = {name: f"{name}_r{r}" for name in _DEFINED.findall(body)}
    rename.update({name: f"{name}_r{r}" for row in range(block.m) for name in (f"%a{row}_{c}" for c in range(len(block.types)))})
    rename["%row"] = f"%row{r}"
    text = _NAME.sub(lambda match: rename.get(match.group(0), match.group(0)), body)
    return text, [rename.get(name, name) for names in block.current for name in names]


def _indent(text: str, spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in text.splitlines())


# Cached: block_product builds a shape's module to see that it fits before the custom op builds it.
@functools.cache
def module_asm(kernel: Kernel, m: int, n: int, k: int, elem: str, body: Callable[[Block], str], y: str | None = None) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>, blocks:
    tensor<n x k/block_size x block_bytes x i8>) -> tensor<m x n x y>`` and its dispatch,
    whose block loop is ``body(block)``. With ``elem`` "i16" the function takes ``(planes:
    tensor<m x 2k x i8>, scales: tensor<m x k/GROUP x f32>, sums: tensor<m x k/sum_group x
    f32>, blocks)``. ``y``: the result's element type (f32, bf16 or f16; by default
    :func:`result_type`): the sums are float32 and rounded once to it as they are stored, so
    that a half-precision model needs no conversion dispatch after each product."""
    what = f"{kernel.layout.upper()} kernel"
    if elem not in kernel.elements:
        raise ValueError(f"{what}: activations of type {elem} are not supported; expected one of {list(kernel.elements)}")
    y_elem = result_type(elem) if y is None else y
    if y_elem not in ("f32", "bf16", "f16"):
        raise ValueError(f"{what}: results of type {y_elem} are not supported; expected f32, bf16 or f16")
    if k % kernel.block_size:
        raise ValueError(f"{what}: K={k} is not a multiple of the block size {kernel.block_size}")
    name, nb, nbytes, t = kernel.function_name(m, n, k, elem, y_elem), k // kernel.block_size, kernel.block_bytes, kernel.rows_per_workgroup
    grouped, ng = elem == "i16", k // GROUP
    kx, xe = (2 * k, "i8") if grouped else (k, elem)  # int16 x: its two int8 planes
    x_t = f"memref<{m}x{kx}x{xe}, strided<[{kx}, 1], offset: ?>>"
    w_t = f"memref<{n}x{nb}x{nbytes}xi8, strided<[{nb * nbytes}, {nbytes}, 1], offset: ?>>"
    y_t = f"memref<{m}x{n}x{y_elem}, strided<[{n}, 1], offset: ?>>"
    g_t = f"memref<{m}x{ng}xf32, strided<[{ng}, 1], offset: ?>>"
    ns = k // kernel.sum_group
    s_t = f"memref<{m}x{ns}xf32, strided<[{ns}, 1], offset: ?>>"
    block = Block(kernel, m, k, elem, x_t, w_t, g_t, s_t)
    loop_body = body(block)
    if 4 * t * m > STACK_BYTES:  # %sums, each tile row's result so far
        raise ValueError(f"{what}: x [{m}, {k}] needs {4 * t * m} bytes of scratch, more than the {STACK_BYTES} a dispatch may hold")
    together = kernel.rows_at_once if m == 1 and k * _BYTES[elem] >= X_CHUNK_BYTES else 1
    rows, slots, copies = range(m), range(len(block.types)), range(together)
    bodies, finals = zip(*(_row_copy(loop_body, block, r) for r in copies))
    consts = "\n".join(f"      %r{i} = arith.constant {i} : index" for i in rows)
    consts += "".join(f"\n      %cr{r} = arith.constant {r * (t // together)} : index" for r in copies)
    zeros = "\n".join(f"      %zero{c} = arith.constant dense<0.0> : {block.types[c]}" for c in slots)
    inits = ", ".join(f"%a{i}_{c}_r{r} = %zero{c}" for r in copies for i in rows for c in slots)
    types = ", ".join(block.types[c] for _ in copies for _ in rows for c in slots)
    yields = ", ".join(name for names in finals for name in names)

    sc_t = f"memref<{t}x{m}xf32>"
    sums = f"%sums = memref.alloca() : {sc_t}"

    def add_chunk(r: int, i: int) -> str:
        lines, total = [], None
        for c in slots:
            s = f"%s{i}_{c}_r{r}"
            lines.append(f"{s} = vector.reduction <add>, %acc#{(r * m + i) * len(slots) + c} : {block.types[c]} into f32")
            if total is not None:
                lines.append(f"{s}t = arith.addf {total}, {s} : f32")
            total = s + ("t" if total is not None else "")
        at = f"%sums[%i{r}, %r{i}]"
        lines += [f"%old{i}_r{r} = memref.load {at} : {sc_t}", f"%new{i}_r{r} = arith.addf %old{i}_r{r}, {total} : f32", f"memref.store %new{i}_r{r}, {at} : {sc_t}"]
        return "\n".join(lines)

    def store(i: int) -> str:
        lines, total = [f"%y{i} = memref.load %sums[%i, %r{i}] : {sc_t}"], f"%y{i}"
        if y_elem != "f32":
            lines.append(f"%t{i} = arith.truncf {total} : f32 to {y_elem}")
            total = f"%t{i}"
        return "\n".join([*lines, f"memref.store {total}, %y[%r{i}, %row] : {y_t}"])

    # The tile's rows go rows_at_once at a time, copy r taking the r-th of as many equal
    # parts of the tile, so that each copy's weight rows are one stream: rows next to each
    # other made short streams (each weight row's few KiB), and 8192x2048 products 2x slower.
    # Where the last tile has fewer rows, a copy past them reads the last row again (its sums
    # land in scratch rows no store reads).
    tile_rows = []
    for r in copies:
        tile_rows += [f"%i{r} = arith.addi %i, %cr{r} : index", f"%row{r}_at = arith.addi %first, %i{r} : index", f"%row{r} = arith.minsi %row{r}_at, %clast : index"]
    # Rows of x are read once per weight row: in chunks of blocks whose x fits in L1 (each
    # weight row's partial sums kept in %sums), not all of K, when x is large (M=8: 64 KiB).
    # One row of x goes in one pass: a 2048x8192 Q8_0 product took 1.02 ms so against 1.25 ms
    # in passes of 16 KiB (interleaved rounds), the weight rows then read in one stream each.
    chunk = nb if m == 1 else max(1, X_CHUNK_BYTES // (m * kernel.block_size * _BYTES[elem]))
    zero_sums = _indent("\n".join(f"memref.store %fz, %sums[%i, %r{i}] : {sc_t}" for i in rows), 8)
    add_chunks = _indent("\n".join(add_chunk(r, i) for r in copies for i in rows), 10)
    row_lines = _indent("\n".join(tile_rows), 10)
    stores = _indent("\n".join(store(i) for i in rows), 8)
    x_tensor, w_tensor, y_tensor = f"tensor<{m}x{kx}x{xe}>", f"tensor<{n}x{nb}x{nbytes}xi8>", f"tensor<{m}x{n}x{y_elem}>"
    g_tensor, s_tensor = f"tensor<{m}x{ng}xf32>", f"tensor<{m}x{ns}xf32>"
    # int16 x: two more bindings (and arguments), each group's scale %xd and sum %xs.
    g_bindings = ", %db: !stream.binding, %sb: !stream.binding" if grouped else ""
    g_spans = f"\n      %xd = stream.binding.subspan %db[%c0] : !stream.binding -> {g_t}\n      %xs = stream.binding.subspan %sb[%c0] : !stream.binding -> {s_t}" if grouped else ""
    g_args, g_names, g_types = (f", %xd: {g_tensor}, %xs: {s_tensor}", ", %xd, %xs", f", {g_tensor}, {s_tensor}") if grouped else ("", "", "")
    return f"""module {{
stream.executable private @{name}_exe {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %g = arith.constant {-(-n // t)} : index
    %one = arith.constant 1 : index
    stream.return %g, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xb: !stream.binding{g_bindings}, %wb: !stream.binding, %yb: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %cbs = arith.constant {kernel.block_size} : index
      %cn = arith.constant {n} : index
      %ct = arith.constant {t} : index
      %clast = arith.constant {n - 1} : index
      %cpart = arith.constant {t // together} : index
      %cnb = arith.constant {nb} : index
{consts}
{zeros}
      %x = stream.binding.subspan %xb[%c0] : !stream.binding -> {x_t}{g_spans}
      %w = stream.binding.subspan %wb[%c0] : !stream.binding -> {w_t}
      %y = stream.binding.subspan %yb[%c0] : !stream.binding -> {y_t}
      %wg = stream.dispatch.workgroup.id[0] : index
      %first = arith.muli %wg, %ct : index
      %left = arith.subi %cn, %first : index
      %count = arith.minsi %ct, %left : index
      %parts = arith.minsi %count, %cpart : index
      {sums}
      %fz = arith.constant 0.0 : f32
      scf.for %i = %c0 to %count step %c1 {{
{zero_sums}
      }}
      %cchunk = arith.constant {chunk} : index
      scf.for %b0 = %c0 to %cnb step %cchunk {{
        %b0e = arith.addi %b0, %cchunk : index
        %b1 = arith.minsi %b0e, %cnb : index
        scf.for %i = %c0 to %parts step %c1 {{
{row_lines}
          %acc:{m * len(block.types) * together} = scf.for %b = %b0 to %b1 step %c1 iter_args({inits}) -> ({types}) {{
            %k = arith.muli %b, %cbs : index
{_indent(chr(10).join(bodies), 12)}
            scf.yield {yields} : {types}
          }}
{add_chunks}
        }}
      }}
      scf.for %i = %c0 to %count step %c1 {{
        %row = arith.addi %first, %i : index
{stores}
      }}
      return
    }}
  }}
}}
util.func private @{name}(%x: {x_tensor}{g_args}, %w: {w_tensor}) -> {y_tensor} {{
  %y = flow.dispatch @{name}_exe::@{name}(%x{g_names}, %w) : ({x_tensor}{g_types}, {w_tensor}) -> {y_tensor}
  util.return %y : {y_tensor}
}}
}}
"""
