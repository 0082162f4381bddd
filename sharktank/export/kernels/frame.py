"""The frame every hand-written dispatch shares: a module holding a ``stream.executable``
with one export of a fixed 1-D workgroup count, its ``func.func`` over ``!stream.binding``
operands (viewed as memrefs), and the ``util.func`` that ``flow.dispatch``es it; a generator
writes only the function's body (:func:`executable`).

Bindings are memrefs with ``offset: ?`` strided layouts: stream packs bindings at offsets in
one buffer, and a plain identity memref would read from the buffer's start (a segfault).

An input may have a dynamic leading dim (``None`` in its shape: a page pool of any number of
pages). The ``util.func`` reads it with ``tensor.dim`` and passes it to ``flow.dispatch``
after the tensors (which carry it as their ``{%d}`` shape); the dispatch function receives
it as an ``index`` after the bindings and sizes the binding's memref with it. A result may
have a dynamic leading dim too, the size of one input's (a prompt's rows in, its rows out):
the one input with a dynamic dim, or where several have one, the input its ``like`` names.
The other dims and the workgroup count stay static.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .mlir import Emitter, Value

__all__ = ["Operand", "executable", "memref_type", "tensor_type"]


Shape = Sequence["int | None"]  # None: a dynamic dim (the leading one only)


def _strides(shape: Shape) -> list[int]:
    """Row-major strides; static, as only the leading dim may be dynamic."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step = step * d if d is not None else None
    return strides[::-1]


def _dims(shape: Shape) -> str:
    return "x".join("?" if d is None else str(d) for d in shape)


def memref_type(shape: Shape, elem: str) -> str:
    """A binding's memref: row-major ``shape`` at a dynamic offset."""
    return f"memref<{_dims(shape)}x{elem}, strided<[{', '.join(map(str, _strides(shape)))}], offset: ?>>"


def tensor_type(shape: Shape, elem: str) -> str:
    return f"tensor<{_dims(shape)}x{elem}>"


@dataclass(frozen=True)
class Operand:
    """A dispatch operand (or result): the hint of its name, its shape (``None`` first: a
    dynamic leading dim) and element type; ``like``: for a result with a dynamic dim, the
    index of the input whose leading dim it has (needed only where several inputs have one)."""

    hint: str
    shape: tuple["int | None", ...]
    elem: str
    like: int | None = None

    def __post_init__(self):
        if None in self.shape[1:]:
            raise ValueError(f"operand {self.hint}: only the leading dim may be dynamic, found {_dims(self.shape)}")

    @property
    def dynamic(self) -> bool:
        """Whether the leading dim is dynamic."""
        return bool(self.shape) and self.shape[0] is None

    @property
    def tensor(self) -> str:
        return tensor_type(self.shape, self.elem)

    @property
    def memref(self) -> str:
        return memref_type(self.shape, self.elem)


Body = Callable[[Emitter, Value, list[Value]], None]


def _size(sizes: dict[int, Value], i: int) -> str:
    """The ``{%d}`` shape annotation of input ``i``'s type ("" for a static one)."""
    return f"{{{sizes[i]}}}" if i in sizes else ""


def _source(inputs: Sequence[Operand], i: int, op: Operand) -> int:
    """The input whose dynamic size operand ``i`` (of the inputs, then the results) ``op`` has:
    its own, or for a dynamic result the one dynamic input's (checked by :func:`executable`);
    -1 for a static one."""
    if not op.dynamic:
        return -1
    if i < len(inputs):
        return i
    return op.like if op.like is not None else next(j for j, other in enumerate(inputs) if other.dynamic)


def executable(name: str, workgroups: int, inputs: Sequence[Operand], outputs: Sequence[Operand], body: Body) -> str:
    """A module holding ``util.func @name(inputs) -> outputs`` and the dispatch it calls:
    ``workgroups`` workgroups, each running ``body(emitter, workgroup_id, memrefs)`` with the
    memrefs of ``inputs`` then ``outputs``, in order (a dynamic leading dim: ``memref.dim``
    of its memref, :meth:`.Emitter.dim`)."""
    dynamic = [i for i, op in enumerate(inputs) if op.dynamic]
    for op in outputs:
        if op.dynamic and (op.like not in dynamic if op.like is not None else len(dynamic) != 1):
            raise ValueError(f"{name}: a result's dynamic leading dim must be one input's (the one dynamic input's, or where several are, "
                             f"the input `like` names), found inputs {[op.tensor for op in inputs]} and result {op.tensor} like {op.like}")
    e = Emitter()
    e.line("module {")
    e.line(f"stream.executable private @{name}_exe {{")
    with e.region():
        e.line(f"stream.executable.export public @{name} workgroups() -> (index, index, index) {{")
        with e.region():
            count, one = e.const(workgroups), e.const(1)
            e.line(f"stream.return {count}, {one}, {one} : index, index, index")
        e.line("}")
        e.line("builtin.module {")
        with e.region():
            bindings = [Value(e.fresh(f"{op.hint}b"), "!stream.binding") for op in (*inputs, *outputs)]
            sizes = {i: Value(e.fresh(f"{inputs[i].hint}d"), "index") for i in dynamic}  # after the bindings, as flow.dispatch passes them
            params = [f"{b}: !stream.binding" for b in bindings] + [f"{d}: index" for d in sizes.values()]
            e.line(f"func.func @{name}({', '.join(params)}) {{")
            with e.region():
                zero = e.const(0)
                views = [e.assign(op.hint, f"stream.binding.subspan {b}[{zero}] : !stream.binding -> {op.memref}{_size(sizes, _source(inputs, i, op))}", op.memref)
                         for i, (b, op) in enumerate(zip(bindings, (*inputs, *outputs)))]
                wg = e.assign("wg", "stream.dispatch.workgroup.id[0] : index", "index")
                body(e, wg, views)
                e.line("return")
            e.line("}")
        e.line("}")
    e.line("}")
    args = [Value(e.fresh(op.hint), op.tensor) for op in inputs]
    results = ", ".join(op.tensor for op in outputs)
    e.line(f"util.func private @{name}({', '.join(f'{a}: {a.type}' for a in args)}) -> ({results}) {{")
    with e.region():
        sizes = {i: e.assign(f"{inputs[i].hint}d", f"tensor.dim {args[i]}, {e.const(0)} : {args[i].type}", "index") for i in dynamic}
        outs = [e.fresh(op.hint) for op in outputs]
        operands = ", ".join(map(str, (*args, *sizes.values())))
        in_types = ", ".join([f"{a.type}{_size(sizes, i)}" for i, a in enumerate(args)] + ["index"] * len(sizes))
        out_types = ", ".join(f"{op.tensor}{_size(sizes, _source(inputs, len(inputs) + j, op))}" for j, op in enumerate(outputs))
        e.line(f"{', '.join(outs)} = flow.dispatch @{name}_exe::@{name}({operands}) : ({in_types}) -> ({out_types})")
        e.line(f"util.return {', '.join(outs)} : {results}")
    e.line("}")
    e.line("}")
    return e.text() + "\n"
