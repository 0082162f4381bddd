"""The frame every hand-written dispatch shares: a module holding a ``stream.executable``
with one export of a fixed 1-D workgroup count, its ``func.func`` over ``!stream.binding``
operands (viewed as memrefs), and the ``util.func`` that ``flow.dispatch``es it; a generator
writes only the function's body (:func:`executable`).

Bindings are memrefs with ``offset: ?`` strided layouts: stream packs bindings at offsets in
one buffer, and a plain identity memref would read from the buffer's start (a segfault).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .mlir import Emitter, Value

__all__ = ["Operand", "executable", "memref_type", "tensor_type"]


def _strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def memref_type(shape: Sequence[int], elem: str) -> str:
    """A binding's memref: row-major ``shape`` at a dynamic offset."""
    return f"memref<{'x'.join(map(str, shape))}x{elem}, strided<[{', '.join(map(str, _strides(shape)))}], offset: ?>>"


def tensor_type(shape: Sequence[int], elem: str) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{elem}>"


@dataclass(frozen=True)
class Operand:
    """A dispatch operand (or result): the hint of its name, its shape and element type."""

    hint: str
    shape: tuple[int, ...]
    elem: str

    @property
    def tensor(self) -> str:
        return tensor_type(self.shape, self.elem)

    @property
    def memref(self) -> str:
        return memref_type(self.shape, self.elem)


Body = Callable[[Emitter, Value, list[Value]], None]


def executable(name: str, workgroups: int, inputs: Sequence[Operand], outputs: Sequence[Operand], body: Body) -> str:
    """A module holding ``util.func @name(inputs) -> outputs`` and the dispatch it calls:
    ``workgroups`` workgroups, each running ``body(emitter, workgroup_id, memrefs)`` with the
    memrefs of ``inputs`` then ``outputs``, in order."""
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
            e.line(f"func.func @{name}({', '.join(f'{b}: !stream.binding' for b in bindings)}) {{")
            with e.region():
                zero = e.const(0)
                views = [e.assign(op.hint, f"stream.binding.subspan {b}[{zero}] : !stream.binding -> {op.memref}", op.memref)
                         for b, op in zip(bindings, (*inputs, *outputs))]
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
        outs = [e.fresh(op.hint) for op in outputs]
        in_types = ", ".join(a.type for a in args)
        e.line(f"{', '.join(outs)} = flow.dispatch @{name}_exe::@{name}({', '.join(map(str, args))}) : ({in_types}) -> ({results})")
        e.line(f"util.return {', '.join(outs)} : {results}")
    e.line("}")
    e.line("}")
    return e.text() + "\n"
