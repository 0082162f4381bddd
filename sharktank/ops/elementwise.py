"""Elementwise ops: ``elementwise(fn, *args)``, arithmetic, ``to``.

Rule (one for the family): operands broadcast as in torch. Split operands must split the
same result dim into the same sizes; replicated and plain operands are cut locally to
match (no transfer). The result is split when any operand is split, else replicated.
Unreduced operands are allowed only where the op is linear in them: ``add``/``sub`` of
unreduced tensors, an unreduced plus a replicated value (added to one shard only, so the
sum counts it once), and ``mul``/``div`` of one unreduced tensor by non-unreduced values.
"""

from __future__ import annotations

import operator

from numbers import Number
from typing import Any, Callable

import torch

from ..types import ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor
from ._build import ShardingError, cut_like_split, like, replicated_of, split_of, unreduced_of
from ._dispatch import sharded_op

__all__ = ["elementwise", "add", "sub", "mul", "div", "to"]

Operand = torch.Tensor | ShardedTensor | Number


def _tensors(fn, *args, **kwargs):
    return [a for a in args if isinstance(a, (torch.Tensor, ShardedTensor))]


def shardwise(op: str, fn: Callable, operands: tuple, kwargs: dict | None = None, partial: str = "refuse") -> ShardedTensor:
    """Apply ``fn`` shard by shard over broadcast operands (see the module rule).

    ``partial``: how unreduced operands are treated: ``"refuse"``, ``"per_shard"`` (the op is
    linear in them) or ``"first_shard"`` (add the other operands to shard 0 only).
    """
    kwargs = kwargs or {}
    ref = operands[0]
    if _all_alike(ref, operands) and (partial != "refuse" or not isinstance(ref, UnreducedTensor)):
        # Fast path: same type, shape and split; no broadcasting or cutting.
        out = [fn(*row, **kwargs) for row in zip(*[x._shards for x in operands])]
        if out[0].shape == ref._shards[0].shape:
            return type(ref)._make(tuple(out), ref._devices, ref._shape, getattr(ref, "shard_dim", None))
        return like(ref, out)
    sharded = [x for x in operands if isinstance(x, ShardedTensor)]
    ref = sharded[0]
    n, devices = ref.shard_count, ref.devices
    rank = max(x.ndim for x in operands if isinstance(x, (torch.Tensor, ShardedTensor)))
    split_dim = sizes = None
    n_partial = 0
    for x in sharded:
        if x.shard_count != n:
            raise ShardingError(f"ops.{op}: operands have {n} and {x.shard_count} shards")
        if isinstance(x, SplitPrimitiveTensor):
            d, s = x.shard_dim + rank - x.ndim, x.shard_sizes
            if split_dim is None:
                split_dim, sizes = d, s
            elif (d, s) != (split_dim, sizes):
                raise ShardingError(
                    f"ops.{op}: split operands disagree: result dim {split_dim} in sizes {sizes} vs "
                    f"result dim {d} in sizes {s}; reshard one of them first"
                )
        elif isinstance(x, UnreducedTensor):
            n_partial += 1
    if n_partial:
        if partial == "refuse":
            raise ShardingError(
                f"ops.{op} is not linear, and an operand is an UnreducedTensor (a sum of shards); "
                f"call ops.all_reduce on it first"
            )
        if split_dim is not None:
            raise ShardingError(f"ops.{op}: cannot mix split and unreduced operands; all_reduce or reshard first")

    cols = []
    for x in operands:
        if isinstance(x, ShardedTensor):
            shards = x.shards
            if split_dim is not None and not isinstance(x, SplitPrimitiveTensor):
                shards = cut_like_split(shards, split_dim - (rank - x.ndim), sizes, op)
            cols.append(shards)
        elif isinstance(x, torch.Tensor):
            cols.append(cut_like_split((x,) * n, split_dim - (rank - x.ndim), sizes, op) if split_dim is not None else (x,) * n)
        else:
            cols.append((x,) * n)

    if n_partial and partial == "first_shard":
        return _add_to_first(fn, operands, cols, kwargs, devices)
    out = [fn(*row, **kwargs) for row in zip(*cols)]
    if split_dim is not None:
        return split_of(out, split_dim, devices)
    if n_partial:
        return unreduced_of(out, devices)
    return replicated_of(out, devices)


def _all_alike(ref, operands) -> bool:
    """Same sharded type, global shape, devices and (for splits) split dim and sizes."""
    t = type(ref)
    if t not in _SHARDED_TYPES:
        return False
    shape, devices = ref._shape, ref._devices
    same = _same_traced_shape if type(ref._shards[0]) is not torch.Tensor else operator.eq
    for x in operands:
        if type(x) is not t or x._devices != devices or not same(x._shape, shape):
            return False
    if t is SplitPrimitiveTensor:
        sizes = ref.shard_sizes
        return all(x.shard_dim == ref.shard_dim and x.shard_sizes == sizes for x in operands)
    return True


def _same_traced_shape(a: torch.Size, b: torch.Size) -> bool:
    """Equal shapes without adding a guard on symbolic sizes: a dynamic length that is not
    known equal counts as different (comparing it plainly would make torch.export guard on
    e.g. a query length differing from the cache length)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(x == y if type(x) is int and type(y) is int else statically_known_true(x == y) for x, y in zip(a, b))


_SHARDED_TYPES = (SplitPrimitiveTensor, ReplicatedTensor, UnreducedTensor)


def _add_to_first(fn, operands, cols, kwargs, devices) -> UnreducedTensor:
    # Unreduced u plus replicated values r: sum_i(u_i) + r == (u_0 + r) + sum_{i>0} u_i.
    first = fn(*[c[0] for c in cols], **kwargs)
    u = next(x for x in operands if isinstance(x, UnreducedTensor))
    # contiguous(): an expanded (stride-0) shard would make a later ops.view fail where
    # torch's view of the same value works (found by tests/reliability fuzzing, seed 5521).
    rest = [s.to(first.dtype).expand(first.shape).contiguous() for s in u.shards[1:]]
    return unreduced_of([first, *rest], devices)


@sharded_op(key=_tensors)
def elementwise(fn: Callable[..., torch.Tensor], *args: Operand, **kwargs: Any) -> torch.Tensor | ShardedTensor:
    """Apply the elementwise torch function ``fn`` to tensors, sharded tensors and scalars.

    ``fn`` is called once per shard with each operand's local piece (and ``kwargs``).
    Follows the family rule in :mod:`sharktank.ops.elementwise`; ``fn`` must be
    elementwise (not linear in general, so unreduced operands are refused).
    """


@elementwise.register(torch.Tensor, variadic=True)
def _elementwise_torch(fn, *args, **kwargs):
    return fn(*args, **kwargs)


@elementwise.register(object, variadic=True)
def _elementwise_sharded(fn, *args, **kwargs):
    return shardwise(f"elementwise({getattr(fn, '__name__', fn)})", fn, args, kwargs)


def _binary(name: str, fn: Callable, partial_rule: Callable[[Any, Any], str]):
    def impl(a, b):
        return shardwise(name, fn, (a, b), None, partial_rule(a, b))

    return impl


def _add_rule(a, b) -> str:
    both = isinstance(a, UnreducedTensor) and isinstance(b, UnreducedTensor)
    return "per_shard" if both else "first_shard"


def _mul_rule(a, b) -> str:
    return "refuse" if isinstance(a, UnreducedTensor) and isinstance(b, UnreducedTensor) else "per_shard"


def _div_rule(a, b) -> str:
    return "refuse" if isinstance(b, UnreducedTensor) else "per_shard"


@sharded_op(nargs=2)
def add(a: Operand, b: Operand) -> torch.Tensor | ShardedTensor:
    """``a + b`` with broadcasting; sharded operands follow the elementwise rule.

    Unreduced + unreduced adds shard by shard; unreduced + replicated/plain/scalar adds the
    other value to shard 0 only, so the reduced value is right.
    """


@sharded_op(nargs=2)
def sub(a: Operand, b: Operand) -> torch.Tensor | ShardedTensor:
    """``a - b`` with broadcasting (as :func:`add` for unreduced operands)."""


@sharded_op(nargs=2)
def mul(a: Operand, b: Operand) -> torch.Tensor | ShardedTensor:
    """``a * b`` with broadcasting; an unreduced operand may be scaled by a non-unreduced one."""


@sharded_op(nargs=2)
def div(a: Operand, b: Operand) -> torch.Tensor | ShardedTensor:
    """``a / b`` with broadcasting; an unreduced numerator may be divided by a non-unreduced value."""


def _neg_unreduced(x):
    return unreduced_of([-s for s in x.shards], x.devices) if isinstance(x, UnreducedTensor) else x


def _sub_sharded(a, b):
    if isinstance(b, UnreducedTensor) and not isinstance(a, UnreducedTensor):
        # r - sum(u_i) == r + sum(-u_i)
        return shardwise("sub", torch.add, (a, _neg_unreduced(b)), None, "first_shard")
    return shardwise("sub", torch.sub, (a, b), None, _add_rule(a, b))


for _op, _fn, _rule in ((add, torch.add, _add_rule), (mul, torch.mul, _mul_rule), (div, torch.div, _div_rule)):
    _op.register(object, object)(_fn)
    _impl = _binary(_op.__name__, _fn, _rule)
    _op.register(ShardedTensor, object)(_impl)
    _op.register(object, ShardedTensor)(_impl)
sub.register(object, object)(torch.sub)
sub.register(ShardedTensor, object)(_sub_sharded)
sub.register(object, ShardedTensor)(_sub_sharded)


@sharded_op()
def to(t: torch.Tensor | ShardedTensor, *args: Any, **kwargs: Any) -> torch.Tensor | ShardedTensor:
    """``Tensor.to`` shard by shard (dtype conversions; placement is unchanged).

    Moving between logical devices is :func:`transfer_to_logical_device`, not ``to``.
    """


@to.register(torch.Tensor)
def _to_torch(t, *args, **kwargs):
    return t.to(*args, **kwargs)


@to.register(ShardedTensor)
def _to_sharded(t, *args, **kwargs):
    return like(t, [s.to(*args, **kwargs) for s in t.shards])
