"""The op dispatcher.

A public op is an ordinary typed, documented Python function decorated with
:func:`sharded_op`. Its body is never run; the decorator turns it into a dispatcher
that:

1. picks an implementation by the types of the dispatch arguments (registered with
   ``@op.register(type, ...)``, subclasses match, the most specific registration wins,
   the choice is cached per type tuple);
2. runs the transfer-if-needed step (:func:`sharktank.ops.transfer_if_needed`) over every
   sharded argument, unless the op declares ``places_data=True`` because it moves or
   places data itself;
3. calls the implementation and marks sharded results pinned exactly when every
   sharded operand was pinned.

``inspect.signature`` and ``help()`` show the decorated function's own signature and
docstring.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch

from ..types import ShardedTensor
from ._placement import place_operands, pin_result

__all__ = ["sharded_op", "NoImplementationError", "registered_ops"]

_ALL_OPS: dict[str, Callable] = {}


class NoImplementationError(TypeError):
    """No implementation is registered for the argument types an op was called with."""


def _type_name(t: type) -> str:
    return getattr(t, "__name__", str(t))


class _Dispatcher:
    __slots__ = ("name", "signature", "nargs", "key", "variadic_from", "table", "cache")

    def __init__(self, fn: Callable, nargs: int, key: Callable | None):
        self.name = fn.__name__
        self.signature = inspect.signature(fn)
        self.nargs = nargs
        self.key = key
        self.table: list[tuple[tuple[type, ...], bool, Callable]] = []
        self.cache: dict[tuple[type, ...], Callable] = {}

    def register(self, *types: type, variadic: bool = False):
        """Register an implementation for these argument types.

        With ``variadic=True`` the last type also matches any number of further
        arguments (for ops like ``elementwise(fn, *args)`` and ``cat(tensors)``).
        """

        def decorate(impl: Callable) -> Callable:
            self.table.append((types, variadic, impl))
            self.cache.clear()
            return impl

        return decorate

    def resolve(self, key: tuple[type, ...]) -> Callable:
        best, best_score = None, None
        for types, variadic, impl in self.table:
            score = _match(types, variadic, key)
            if score is not None and (best_score is None or score < best_score):
                best, best_score = impl, score
        if best is None:
            got = ", ".join(_type_name(t) for t in key)
            known = "; ".join(
                "(" + ", ".join(_type_name(t) for t in types) + (", ..." if variadic else "") + ")"
                for types, variadic, _ in self.table
            )
            raise NoImplementationError(f"ops.{self.name} has no implementation for ({got}); registered: {known}")
        if not torch.compiler.is_compiling():
            # Dynamo would report a cache write during tracing as a side effect.
            self.cache[key] = best
        return best


def _match(types: tuple[type, ...], variadic: bool, key: tuple[type, ...]) -> int | None:
    """Specificity score (lower is more specific) or None when the types do not match."""
    if len(key) != len(types) and not (variadic and len(key) >= len(types) - 1):
        return None
    score = 0
    for i, k in enumerate(key):
        want = types[min(i, len(types) - 1)]
        if not issubclass(k, want):
            return None
        score += k.__mro__.index(want) if want in k.__mro__ else 0
    return score


def sharded_op(*, nargs: int = 1, key: Callable[..., Sequence[Any]] | None = None, places_data: bool = False):
    """Make a dispatching op from a typed, documented stub function.

    ``nargs``: dispatch on the types of the first ``nargs`` arguments. ``key``: instead,
    a function of the call's arguments returning the values to dispatch on.
    ``places_data``: the op moves or places data itself, so the dispatcher must not run
    transfer-if-needed before it (transfers, barriers, collectives taking ``devices=``).
    """

    def decorate(fn: Callable) -> Callable:
        d = _Dispatcher(fn, nargs, key)
        sig = d.signature
        name = d.name
        cache = d.cache
        resolve = d.resolve

        def bind(args, kwargs):
            # Slow path: dispatch arguments given by keyword.
            ba = sig.bind(*args, **kwargs)
            positional = []
            rest = {}
            for p in sig.parameters.values():
                if p.name not in ba.arguments:
                    continue
                v = ba.arguments[p.name]
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and len(positional) < nargs and not rest:
                    positional.append(v)
                elif p.kind is p.VAR_POSITIONAL:
                    positional.extend(v)
                elif p.kind is p.VAR_KEYWORD:
                    rest.update(v)
                else:
                    rest[p.name] = v
            return tuple(positional), rest

        if key is None:

            def dispatch_key(args, kwargs):
                if len(args) < nargs:
                    args, kwargs = bind(args, kwargs)
                return tuple([type(a) for a in args[:nargs]]), args, kwargs

        else:

            def dispatch_key(args, kwargs):
                return tuple([type(a) for a in key(*args, **kwargs)]), args, kwargs

        if places_data:

            @functools.wraps(fn)
            def op(*args, **kwargs):
                k, args, kwargs = dispatch_key(args, kwargs)
                impl = cache.get(k) or resolve(k)
                return impl(*args, **kwargs)

        else:

            @functools.wraps(fn)
            def op(*args, **kwargs):
                k, args, kwargs = dispatch_key(args, kwargs)
                impl = cache.get(k) or resolve(k)
                args, kwargs, pinned = place_operands(name, args, kwargs)
                out = impl(*args, **kwargs)
                return pin_result(out) if pinned else out

        op.register = d.register
        op.dispatcher = d
        op.places_data = places_data
        _ALL_OPS[name] = op
        return op

    return decorate


def registered_ops() -> dict[str, Callable]:
    """Every public op by name (for tests and tools)."""
    return dict(_ALL_OPS)


# Types used in registrations.
Sharded = ShardedTensor
