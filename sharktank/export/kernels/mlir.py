"""A small MLIR text emitter for the hand-written kernels: every value it defines gets a name
it makes itself (``%<hint>_<n>``, ``n`` counting every value of the module), so two bodies, or
one body emitted twice, cannot clash; regions (``scf.for``, ``scf.if``) are Python functions
of their block arguments. Values carry their type, so an op's type annotations are derived
from its operands. Forms that differ between IREE releases come from :mod:`.syntax`.
"""

from __future__ import annotations

import contextlib
import math
import re
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from . import isa, syntax

__all__ = ["Emitter", "Value", "elem_of", "lanes_of", "vector"]

_HINT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Value:
    """An SSA value: its name (``%x_3``, or ``%r_7#2`` for a region's result) and type."""

    name: str
    type: str

    def __str__(self) -> str:
        return self.name


def vector(lanes: int, elem: str) -> str:
    """``vector<lanes x elem>``."""
    return f"vector<{lanes}x{elem}>"


def elem_of(type_: str) -> str:
    """The element type of a scalar, vector or memref type (``memref<4x8xf32, ...>``: f32)."""
    if not type_.startswith(("vector<", "memref<", "tensor<")):
        return type_
    return type_[type_.index("<") + 1 :].split(",")[0].rstrip(">").split("x")[-1]


def lanes_of(type_: str) -> int:
    """The lanes of a 1-D vector type."""
    if not type_.startswith("vector<") or type_.count("x") != 1:
        raise ValueError(f"expected a 1-D vector type, found {type_}")
    return int(type_[len("vector<") :].split("x")[0])


def _literal(value, elem: str) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v, elem) for v in value) + "]"
    if elem in ("f32", "f16", "bf16", "f64"):
        value = float(value)
        if math.isfinite(value) and value == int(value) and abs(value) < 2**24:
            return f"{value:.1f}"
        if elem != "f32":
            raise ValueError(f"a {elem} constant must be a small integer, found {value}")
        return "0x" + struct.pack(">f", value).hex().upper()  # exact float32 bits (also inf)
    return str(int(value))


class Emitter:
    """Lines of MLIR, written in order. Each op method writes one op and returns its result."""

    def __init__(self):
        self.lines: list[str] = []
        self._count = 0
        self._depth = 0
        self._constants: list[dict] = [{}]  # per open region: (literal, type) -> its value

    # -- names, lines and regions -------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """A name no other value of this emitter has."""
        if not _HINT.fullmatch(hint):
            raise ValueError(f"a value's hint must be an identifier, found {hint!r}")
        self._count += 1
        return f"%{hint}_{self._count}"

    def line(self, text: str) -> None:
        """One line as it is (an op without results, or a region's delimiter)."""
        self.lines.append("  " * self._depth + text)

    def assign(self, hint: str, op: str, type_: str) -> Value:
        """``%<fresh> = op``, of type ``type_``."""
        value = Value(self.fresh(hint), type_)
        self.line(f"{value} = {op}")
        return value

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Lines indented one more level; constants made inside stay inside."""
        self._depth += 1
        self._constants.append({})
        try:
            yield
        finally:
            self._constants.pop()
            self._depth -= 1

    def text(self) -> str:
        return "\n".join(self.lines)

    # -- constants ------------------------------------------------------------------
    def const(self, value, type_: str = "index") -> Value:
        """``arith.constant`` (a vector type: every lane ``value``, or a list of per-lane
        values), made once per region and reused by the regions inside it."""
        elem = elem_of(type_)
        literal = _literal(value, elem)
        if type_.startswith("vector<"):
            literal = f"dense<{literal}>"
        key = (literal, type_)
        for scope in reversed(self._constants):
            if key in scope:
                return scope[key]
        made = self.assign("c", f"arith.constant {literal} : {type_}", type_)
        self._constants[-1][key] = made
        return made

    # -- arithmetic -----------------------------------------------------------------
    def binary(self, op: str, a: Value, b: Value, hint: str = "v") -> Value:
        """``op a, b`` of one type (``arith.addi``, ``arith.mulf``, ``arith.minsi``, ...)."""
        if a.type != b.type:
            raise ValueError(f"{op}: operands of one type expected, found {a.type} and {b.type}")
        return self.assign(hint, f"{op} {a}, {b} : {a.type}", a.type)

    def unary(self, op: str, a: Value, hint: str = "v") -> Value:
        """``op a`` (``arith.negf``, ``math.absf``, ``math.exp``, ``math.roundeven``)."""
        return self.assign(hint, f"{op} {a} : {a.type}", a.type)

    def cast(self, op: str, a: Value, type_: str, hint: str = "v") -> Value:
        """``op a : a.type to type_`` (``arith.extf``, ``arith.sitofp``, ``vector.bitcast``, ...)."""
        return self.assign(hint, f"{op} {a} : {a.type} to {type_}", type_)

    def cmp(self, op: str, predicate: str, a: Value, b: Value, hint: str = "p") -> Value:
        """``arith.cmpf``/``arith.cmpi`` ``predicate``: i1, or a vector of i1."""
        result = vector(lanes_of(a.type), "i1") if a.type.startswith("vector<") else "i1"
        return self.assign(hint, f"{op} {predicate}, {a}, {b} : {a.type}", result)

    def select(self, cond: Value, a: Value, b: Value, hint: str = "v") -> Value:
        types = a.type if cond.type == "i1" else f"{cond.type}, {a.type}"
        return self.assign(hint, f"arith.select {cond}, {a}, {b} : {types}", a.type)

    def fma(self, a: Value, b: Value, c: Value, hint: str = "acc") -> Value:
        """``a * b + c`` (vectors of one type)."""
        return self.assign(hint, f"vector.fma {a}, {b}, {c} : {a.type}", a.type)

    # -- vectors --------------------------------------------------------------------
    def broadcast(self, scalar: Value, type_: str, hint: str = "v") -> Value:
        return self.assign(hint, f"vector.broadcast {scalar} : {scalar.type} to {type_}", type_)

    def shuffle(self, a: Value, b: Value, mask: Sequence[int], hint: str = "v") -> Value:
        """Lanes ``mask`` of ``a`` then ``b`` (indices past ``a``'s lanes take ``b``'s)."""
        type_ = vector(len(mask), elem_of(a.type))
        return self.assign(hint, f"vector.shuffle {a}, {b} [{', '.join(map(str, mask))}] : {a.type}, {b.type}", type_)

    def slice(self, v: Value, offset: int, size: int, hint: str = "v") -> Value:
        """Lanes ``offset .. offset + size`` of a 1-D vector."""
        return self.assign(hint, syntax.slice_1d(v.name, v.type, offset, size), vector(size, elem_of(v.type)))

    def extract(self, v: Value, position: int, hint: str = "s") -> Value:
        """Lane ``position`` of a 1-D vector, as a scalar."""
        elem = elem_of(v.type)
        return self.assign(hint, syntax.extract(v.name, v.type, position, elem), elem)

    def from_elements(self, scalars: Sequence[Value], hint: str = "v") -> Value:
        type_ = vector(len(scalars), scalars[0].type)
        return self.assign(hint, f"vector.from_elements {', '.join(map(str, scalars))} : {type_}", type_)

    def reduction(self, kind: str, v: Value, hint: str = "s") -> Value:
        """``vector.reduction <kind>`` (add, maxnumf, maximumf, or) of ``v``'s lanes."""
        elem = elem_of(v.type)
        return self.assign(hint, f"vector.reduction <{kind}>, {v} : {v.type} into {elem}", elem)

    def int8_dot(self, acc: Value, unsigned: Value, signed: Value, hint: str = "dot", weight: int = 1) -> Value:
        """``acc`` (vector<16xi32>) plus, in lane i, ``weight`` times the sum of the products of
        bytes 4i..4i+3 of ``unsigned`` (vector<64xi8> read as uint8, every byte below 128) and
        ``signed``, in the form :func:`.isa.current` names: ``vpdpbusd`` (AVX512-VNNI,
        :func:`.syntax.int8_dot`; with a ``weight`` other than 1, into zero, multiplied, then
        added to ``acc``) or, for
        AVX2, per 32-byte half ``vpmaddubsw`` (exact: pair sums of at most 2 * 127 * 128) then
        ``vpmaddwd`` with ``weight`` (:func:`.syntax.madd_bytes`, :func:`.syntax.madd_words`)."""
        form = isa.current().int8_dot
        i32 = vector(16, "i32")
        if form == "avx512_vnni":
            if weight == 1:
                return self.assign(hint, syntax.int8_dot(acc.name, unsigned.name, signed.name), i32)
            dot = self.assign(hint, syntax.int8_dot(self.const(0, i32).name, unsigned.name, signed.name), i32)
            return self.binary("arith.addi", acc, self.binary("arith.muli", dot, self.const(weight, i32), hint), hint)
        if form != "avx2":
            raise ValueError(f"int8_dot: this kernel needs an integer dot product form, found {isa.current()}")
        factor = self.const(weight, vector(16, "i16"))
        halves = []
        for h in range(2):
            u, s = (self.slice(v, 32 * h, 32, hint) for v in (unsigned, signed))
            pairs = self.assign(hint, syntax.madd_bytes(u.name, s.name), vector(16, "i16"))
            halves.append(self.assign(hint, syntax.madd_words(pairs.name, factor.name), vector(8, "i32")))
        return self.binary("arith.addi", acc, self.shuffle(halves[0], halves[1], range(16), hint), hint)

    def bf16_dot(self, acc: Value, a: Value, b: Value, hint: str = "dot") -> Value:
        """``acc`` (vector<16xf32>) plus, in lane i, ``a[2i] * b[2i] + a[2i+1] * b[2i+1]`` of the
        vector<32xbf16> ``a`` and ``b``, in the form :func:`.isa.current` names: ``vdpbf16ps``
        (AVX512-BF16, :func:`.syntax.bf16_dot`) or, for AVX2, each pair's values widened to
        float32 (the high half of a 32-bit pair is its odd value: mask it; the even one: shift
        it up) and two fused multiply-adds, odd then even, as vdpbf16ps sums them."""
        form = isa.current().bf16_dot
        f32 = vector(16, "f32")
        if form == "avx512_bf16":
            return self.assign(hint, syntax.bf16_dot(acc.name, a.name, b.name), f32)
        if form != "avx2":
            raise ValueError(f"bf16_dot: this kernel needs a bfloat16 dot product form, found {isa.current()}")
        i32 = vector(16, "i32")
        (a_odd, a_even), (b_odd, b_even) = (self.bf16_pairs(self.cast("vector.bitcast", v, i32, "bw")) for v in (a, b))
        acc = self.fma(a_odd, b_odd, acc, hint)
        return self.fma(a_even, b_even, acc, hint)

    def to_bf16(self, v: Value, hint: str = "wb") -> Value:
        """A float32 vector rounded to bfloat16 (to nearest even), lane by lane: with AVX512-BF16
        (:func:`.isa.current`) and a multiple of 32 lanes, ``vcvtne2ps2bf16`` per 32 lanes
        (:func:`.syntax.bf16_round`; LLVM spells ``arith.truncf`` to bfloat16 as some ten integer
        operations per 16 lanes); otherwise ``arith.truncf``. ``vcvtne2ps2bf16`` takes a float32
        denormal (below 1.2e-38) as 0, where ``arith.truncf`` keeps its bfloat16 neighbour: the
        same for every value a quantized block or a float16 weight holds (none is that small)."""
        lanes = lanes_of(v.type)
        if isa.current().bf16_dot != "avx512_bf16" or lanes % 32:
            return self.cast("arith.truncf", v, vector(lanes, "bf16"), hint)
        parts = []
        for at in range(0, lanes, 32):
            low, high = self.slice(v, at, 16, hint), self.slice(v, at + 16, 16, hint)
            parts.append(self.assign(hint, syntax.bf16_round(high.name, low.name), vector(32, "bf16")))
        whole = parts[0]
        for part in parts[1:]:
            whole = self.shuffle(whole, part, range(lanes_of(whole.type) + 32), hint)
        return whole

    def bf16_pairs(self, words: Value) -> tuple[Value, Value]:
        """The float32 values of bfloat16 pairs held as 32-bit ``words`` (vector<n x i32>):
        ``(odd, even)``, the high half masked and the low half shifted up."""
        lanes = lanes_of(words.type)
        odd = self.binary("arith.andi", words, self.const(-65536, words.type), "bo")
        even = self.binary("arith.shli", words, self.const(16, words.type), "be")
        return tuple(self.cast("vector.bitcast", half, vector(lanes, "f32"), "bf") for half in (odd, even))

    def widen_bf16(self, v: Value, hint: str = "bw") -> Value:
        """A vector of bfloat16 as float32, lane by lane (a float32's high half: extended as
        integers and shifted up, which LLVM keeps in vector lanes where ``arith.extf`` does not)."""
        lanes = lanes_of(v.type)
        words = self.cast("arith.extui", self.cast("vector.bitcast", v, vector(lanes, "i16"), hint), vector(lanes, "i32"), hint)
        shifted = self.binary("arith.shli", words, self.const(16, vector(lanes, "i32")), hint)
        return self.cast("vector.bitcast", shifted, vector(lanes, "f32"), hint)

    # -- memory ---------------------------------------------------------------------
    def load(self, mem: Value, indices: Sequence[Value], type_: str, hint: str = "ld") -> Value:
        """``vector.load`` of ``type_`` at ``indices``."""
        return self.assign(hint, f"vector.load {mem}[{', '.join(map(str, indices))}] : {mem.type}, {type_}", type_)

    def read_padded(self, mem: Value, indices: Sequence[Value], type_: str, pad: Value, hint: str = "rd") -> Value:
        """``vector.transfer_read`` of ``type_`` at ``indices``: lanes past the end of ``mem``
        read as ``pad`` (never the memory past it)."""
        return self.assign(hint, syntax.transfer_read(mem.name, [v.name for v in indices], pad.name, mem.type, type_), type_)

    def store(self, v: Value, mem: Value, indices: Sequence[Value]) -> None:
        """``vector.store``."""
        self.line(f"vector.store {v}, {mem}[{', '.join(map(str, indices))}] : {mem.type}, {v.type}")

    def load_scalar(self, mem: Value, indices: Sequence[Value], hint: str = "ld") -> Value:
        return self.assign(hint, f"memref.load {mem}[{', '.join(map(str, indices))}] : {mem.type}", elem_of(mem.type))

    def store_scalar(self, v: Value, mem: Value, indices: Sequence[Value]) -> None:
        self.line(f"memref.store {v}, {mem}[{', '.join(map(str, indices))}] : {mem.type}")

    def prefetch(self, mem: Value, indices: Sequence[Value]) -> None:
        """A read prefetch into all cache levels."""
        self.line(f"memref.prefetch {mem}[{', '.join(map(str, indices))}], read, locality<3>, data : {mem.type}")

    def dim(self, mem: Value, index: int, hint: str = "dim") -> Value:
        """``memref.dim``: the size of dim ``index`` of ``mem`` (a dynamic one's)."""
        return self.assign(hint, f"memref.dim {mem}, {self.const(index)} : {mem.type}", "index")

    def alloca(self, type_: str, hint: str = "scratch") -> Value:
        """Stack scratch of ``type_``, aligned to a cache line (64 bytes: a 512-bit load or
        store of it at a multiple of 64 bytes never spans two lines)."""
        return self.assign(hint, f"memref.alloca() {{alignment = 64 : i64}} : {type_}", type_)

    # -- regions --------------------------------------------------------------------
    def for_(
        self, lo: Value, hi: Value, step: Value, body: Callable[[Value, list[Value]], Sequence[Value] | None],
        inits: Sequence[Value] = (), hint: str = "i",
    ) -> list[Value]:
        """``scf.for`` whose body is ``body(induction, carried)``, returning the carried values'
        next ones (as many, of the same types, as ``inits``); the loop's results."""
        iv = Value(self.fresh(hint), "index")
        carried = [Value(self.fresh("it"), v.type) for v in inits]
        types = ", ".join(v.type for v in inits)
        head = f"scf.for {iv} = {lo} to {hi} step {step}"
        result = self.fresh("r") if inits else None
        if inits:
            args = ", ".join(f"{a} = {v}" for a, v in zip(carried, inits))
            self.line(f"{result}:{len(inits)} = {head} iter_args({args}) -> ({types}) {{")
        else:
            self.line(f"{head} {{")
        with self.region():
            out = list(body(iv, carried) or ())
            self._yield(out, inits, "scf.for")
        self.line("}")
        return [Value(f"{result}#{i}", v.type) for i, v in enumerate(inits)]

    def if_(self, cond: Value, then: Callable[[], Sequence[Value]], otherwise: Callable[[], Sequence[Value]], types: Sequence[str]) -> list[Value]:
        """``scf.if`` with results of ``types`` (none: no results), each branch a function
        returning them."""
        result = self.fresh("r")
        like = [Value("", t) for t in types]
        self.line(f"{result}:{len(types)} = scf.if {cond} -> ({', '.join(types)}) {{" if types else f"scf.if {cond} {{")
        with self.region():
            self._yield(list(then()), like, "scf.if (then)")
        self.line("} else {")
        with self.region():
            self._yield(list(otherwise()), like, "scf.if (else)")
        self.line("}")
        return [Value(f"{result}#{i}", t) for i, t in enumerate(types)]

    def _yield(self, out: list[Value], like: Sequence[Value], what: str) -> None:
        if [v.type for v in out] != [v.type for v in like]:
            raise ValueError(f"{what}: the body yields {[v.type for v in out]}, expected {[v.type for v in like]}")
        if out:
            self.line(f"scf.yield {', '.join(map(str, out))} : {', '.join(v.type for v in out)}")
