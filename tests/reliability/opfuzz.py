"""Differential fuzzing of sharktank.ops: seeded random sequences of ops over sharded values.

A sequence keeps a small pool of values, each a (possibly sharded) tensor next to the plain
torch tensor it stands for. Every step picks an op and operands (from the pool or fresh,
placed as plain/R/P/S(d) on 1-8 of 16 logical devices, pinned or not), computes the torch
result, runs the sharded op and demands one of:

- a result equal to torch (allclose), with consistent shards (replicated shards identical,
  split sizes adding up), on the devices and with the pinned flag the placement rule gives,
  having made exactly the transfers the rule (or the collective's documented count) implies;
- a documented refusal: ``PlacementError`` (only when the placement rule says so),
  ``ShardingError`` or ``NoImplementationError``, with a message naming the op.

Anything else (a wrong number, another exception type, a transfer miscount) is a failure,
reported with the seed and step so that the sequence can be replayed with :func:`run_sequence`.
``python tools/soak.py`` runs many seeds; tests/reliability/test_fuzz_ops.py a CI-sized set.
"""

from __future__ import annotations

import math
import random
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from placing import place
from sharktank import ops
from sharktank.types import ReplicatedTensor, ShardedTensor, ShardingSpec, SplitPrimitiveTensor, UnreducedTensor
from sharktank.types.placement import split_sizes

__all__ = ["Outcome", "FuzzStats", "run_sequence", "run_seeds"]

REFUSALS = (ops.PlacementError, ops.ShardingError, ops.NoImplementationError)
MAX_POOL = 6


@dataclass
class Value:
    x: Any  # torch.Tensor or ShardedTensor
    ref: torch.Tensor


@dataclass
class Step:
    """One op to try: how to call it sharded and on torch, and what to check."""

    name: str
    call: Callable[[], Any]
    ref: Callable[[], Any]
    operands: list  # the sharded/plain operands the dispatcher sees
    kind: str = "compute"  # "compute" (placement rule applies), "collective", "argmax"
    expect: Callable[[Any], str | None] | None = None  # extra check of the result; a message on failure
    transfers: Callable[[], int] | None = None  # exact transfer count for collectives
    keep: bool = True  # add the result to the pool


@dataclass
class Outcome:
    seed: int
    ops: int = 0
    ok: int = 0
    skipped: int = 0  # drawn steps that torch itself rejects (nothing to compare)
    refused: Counter = field(default_factory=Counter)
    per_op: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


@dataclass
class FuzzStats:
    sequences: int = 0
    ops: int = 0
    ok: int = 0
    refused: Counter = field(default_factory=Counter)
    per_op: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.sequences += 1
        self.ops += o.ops
        self.ok += o.ok
        self.refused.update(o.refused)
        self.per_op.update(o.per_op)
        self.failures.extend(o.failures)

    def summary(self) -> str:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(self.refused.items()))
        return (
            f"{self.sequences} sequences, {self.ops} ops ({self.ok} matched torch; refused: {refused or 'none'}); "
            f"{len(self.per_op)} op kinds; {len(self.failures)} failures"
        )


class _Gen:
    """Random shapes, tensors and placements for one sequence."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        # A few device groups per sequence: most operands share group 0, so that ops get past
        # the placement rule; the others (same or different shard counts) exercise it.
        n = self.rng.randint(1, 8)
        self.groups = [tuple(self.rng.sample(range(16), n))]
        self.groups.append(tuple(self.rng.sample(range(16), n)))
        self.groups.append(tuple(self.rng.sample(range(16), self.rng.randint(1, 8))))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def shape(self, rank_min: int = 1, rank_max: int = 4) -> list[int]:
        return [self.rng.randint(1, 6) for _ in range(self.rng.randint(rank_min, rank_max))]

    def tensor(self, shape, positive: bool = False) -> torch.Tensor:
        t = torch.randn(tuple(shape), generator=self.gen)
        return t.abs() + 0.5 if positive else t

    def devices(self) -> tuple[int, ...]:
        r = self.rng.random()
        return self.groups[0] if r < 0.7 else self.groups[1] if r < 0.85 else self.groups[2]

    def placed(self, t: torch.Tensor, plain_ok: bool = True, partial_ok: bool = True, devices=None) -> Any:
        kinds = (["T"] if plain_ok else []) + ["R", "R"] + (["P"] if partial_ok and t.is_floating_point() else [])
        kinds += [f"S{d}" for d in range(t.ndim)] * 2
        kind = self.rng.choice(kinds)
        return place(t, kind, devices or self.devices(), pinned=self.chance(0.3), gen=self.gen)

    def fresh(self, shape, **kw) -> Value:
        positive = kw.pop("positive", False)
        t = self.tensor(shape, positive)
        return Value(self.placed(t, **kw), t)


# --- op builders: each returns a Step (or None when the pool offers nothing suitable) ------------


def _pick(g: _Gen, pool: list[Value], want: Callable[[Value], bool] = lambda v: True) -> Value | None:
    cands = [v for v in pool if want(v)]
    return g.rng.choice(cands) if cands else None


def _partner(g: _Gen, pool: list[Value], shape: list[int], **kw) -> Value:
    """A second operand broadcastable against ``shape``: from the pool when one fits, else fresh."""
    same = _pick(g, pool, lambda v: list(v.ref.shape) == shape and v.ref.dtype == torch.float32)
    if same is not None and g.chance(0.5) and not kw.get("positive"):
        return same
    k = g.rng.randint(0, len(shape))
    sub = [1 if g.chance(0.25) else s for s in shape[len(shape) - k :]]
    if g.chance(0.15):
        sub = [g.rng.randint(1, 3)] + shape  # a leading batch dim on the partner
    return g.fresh(sub, **kw)


def op_binary(g, pool):
    a = _pick(g, pool)
    name = g.rng.choice(["add", "sub", "mul", "div", "elementwise2", "operator"])
    if g.chance(0.15) and name != "elementwise2":
        s = g.rng.choice([2.0, -0.5, 3])
        fo, ft = {"add": (ops.add, torch.add), "sub": (ops.sub, torch.sub), "mul": (ops.mul, torch.mul)}.get(name, (ops.mul, torch.mul))
        if g.chance(0.5):
            return Step(f"{fo.__name__}_scalar", lambda: fo(a.x, s), lambda: ft(a.ref, s), [a.x])
        return Step(f"{fo.__name__}_scalar_lhs", lambda: fo(s, a.x), lambda: ft(s, a.ref), [a.x])
    b = _partner(g, pool, list(a.ref.shape), positive=name == "div")
    x, y = (a, b) if name == "div" or g.chance(0.6) else (b, a)
    if name == "elementwise2":
        fn = lambda p, q: torch.tanh(p) * q + p  # noqa: E731
        return Step("elementwise", lambda: ops.elementwise(fn, x.x, y.x), lambda: fn(x.ref, y.ref), [x.x, y.x])
    if name == "operator":
        sym = g.rng.choice(["+", "-", "*"])
        f = {"+": lambda p, q: p + q, "-": lambda p, q: p - q, "*": lambda p, q: p * q}[sym]
        return Step(f"operator{sym}", lambda: f(x.x, y.x), lambda: f(x.ref, y.ref), [x.x, y.x])
    fo, ft = getattr(ops, name), getattr(torch, name)
    return Step(name, lambda: fo(x.x, y.x), lambda: ft(x.ref, y.ref), [x.x, y.x])


def op_unary(g, pool):
    a = _pick(g, pool)
    choice = g.rng.choice(["tanh", "sigmoid", "neg", "to64", "to32"])
    if choice == "neg":
        return Step("neg", lambda: -a.x, lambda: -a.ref, [a.x])
    if choice in ("to64", "to32"):
        dt = torch.float64 if choice == "to64" else torch.float32
        return Step("to", lambda: ops.to(a.x, dt), lambda: a.ref.to(dt), [a.x])
    fn = getattr(torch, choice)
    return Step("elementwise", lambda: ops.elementwise(fn, a.x), lambda: fn(a.ref), [a.x])


def op_matmul(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 2)
    if a is None:
        return None
    *batch, m, k = a.ref.shape
    n = g.rng.randint(1, 6)
    t = g.chance(0.4)
    rb = (list(batch[g.rng.randint(0, len(batch)) :]) if batch and g.chance(0.5) else [])
    b = g.fresh(rb + ([n, k] if t else [k, n]), plain_ok=True)
    if g.chance(0.2) and not t:
        # The pool value on the right: lhs fresh [..., m2, rows of a].
        *bb, kk, nn = a.ref.shape
        lhs = g.fresh([g.rng.randint(1, 5), kk])
        return Step("matmul", lambda: ops.matmul(lhs.x, a.x), lambda: torch.matmul(lhs.ref, a.ref), [lhs.x, a.x])
    if g.chance(0.2) and not t:
        return Step("operator@", lambda: a.x @ b.x, lambda: a.ref @ b.ref, [a.x, b.x])
    return Step(
        "matmul", lambda: ops.matmul(a.x, b.x, transpose_rhs=t), lambda: torch.matmul(a.ref, b.ref.mT if t else b.ref), [a.x, b.x]
    )


def op_linear(g, pool):
    a = _pick(g, pool)
    k = a.ref.shape[-1] if a.ref.ndim else 1
    if a.ref.ndim == 0:
        return None
    n = g.rng.randint(1, 6)
    w = g.fresh([n, k], partial_ok=False)
    bias = g.fresh([n]) if g.chance(0.6) else None
    operands = [a.x, w.x] + ([bias.x] if bias else [])
    bx, br = (bias.x, bias.ref) if bias else (None, None)
    return Step(
        "linear",
        lambda: ops.linear(a.x, w.x, bx),
        lambda: torch.nn.functional.linear(a.ref, w.ref, br),
        operands,
    )


def _factor(g, n: int) -> list[int]:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    d = g.rng.choice(divs)
    return [d, n // d]


def _target_shape(g, shape: list[int]) -> list[int]:
    r = g.rng.random()
    if r < 0.25 and len(shape) >= 2:  # merge a run of two dims
        i = g.rng.randint(0, len(shape) - 2)
        return shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2 :]
    if r < 0.5:  # factor a dim
        i = g.rng.randint(0, len(shape) - 1)
        return shape[:i] + _factor(g, shape[i]) + shape[i + 1 :]
    if r < 0.6:  # insert a size-1 dim
        i = g.rng.randint(0, len(shape))
        return shape[:i] + [1] + shape[i:]
    if r < 0.7 and 1 in shape:  # drop a size-1 dim
        i = shape.index(1)
        return shape[:i] + shape[i + 1 :] or [1]
    if r < 0.8:
        return [math.prod(shape)]
    # Any factorization of the element count (often moves items between shards).
    n, out = math.prod(shape), []
    while n > 1 and len(out) < 3:
        d = g.rng.choice([d for d in range(1, n + 1) if n % d == 0])
        out.append(d)
        n //= d
    return out + [n] if n > 1 or not out else out


def op_reshape(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    shape = list(a.ref.shape)
    target = _target_shape(g, shape)
    if g.chance(0.2):
        target = list(target)
        target[g.rng.randrange(len(target))] = -1
    which = g.rng.choice(["reshape", "view", "method", "flatten", "unflatten"])
    if which == "flatten" and len(shape) >= 2:
        s = g.rng.randint(0, len(shape) - 1)
        e = g.rng.randint(s, len(shape) - 1)
        return Step("flatten", lambda: ops.flatten(a.x, s, e), lambda: torch.flatten(a.ref, s, e), [a.x])
    if which == "unflatten":
        d = g.rng.randint(0, len(shape) - 1)
        sizes = _factor(g, shape[d])
        return Step("unflatten", lambda: ops.unflatten(a.x, d, sizes), lambda: torch.unflatten(a.ref, d, sizes), [a.x])
    if which == "method" and isinstance(a.x, ShardedTensor):
        return Step("reshape", lambda: a.x.reshape(*target), lambda: a.ref.reshape(target), [a.x])
    if which == "view":
        return Step("view", lambda: ops.view(a.x, target), lambda: a.ref.view(target), [a.x])
    return Step("reshape", lambda: ops.reshape(a.x, target), lambda: a.ref.reshape(target), [a.x])


def op_layout(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    r = a.ref.ndim
    which = g.rng.choice(["transpose", "permute", "expand", "T"])
    if which == "T" and r == 2 and isinstance(a.x, ShardedTensor):
        return Step("transpose", lambda: a.x.T, lambda: a.ref.T, [a.x])
    if which == "transpose" or r == 1 and which == "permute":
        d0, d1 = g.rng.randint(-r, r - 1), g.rng.randint(-r, r - 1)
        return Step("transpose", lambda: ops.transpose(a.x, d0, d1), lambda: a.ref.transpose(d0, d1), [a.x])
    if which == "permute":
        perm = list(range(r))
        g.rng.shuffle(perm)
        return Step("permute", lambda: ops.permute(a.x, perm), lambda: a.ref.permute(*perm), [a.x])
    shape = list(a.ref.shape)
    ones = [i for i, s in enumerate(shape) if s == 1]
    target = list(shape)
    if ones:
        target[g.rng.choice(ones)] = g.rng.randint(1, 4)
    if g.chance(0.4):
        target = [g.rng.randint(1, 3)] + target
    if g.chance(0.2):
        target[-1] = -1
    return Step("expand", lambda: ops.expand(a.x, target), lambda: a.ref.expand(*target), [a.x])


def op_reduce(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    r = a.ref.ndim
    name = g.rng.choice(["sum", "mean"])
    keep = g.chance(0.4)
    c = g.rng.random()
    if c < 0.2:
        fo, ft = getattr(ops, name), getattr(torch, name)
        return Step(name, lambda: fo(a.x), lambda: ft(a.ref), [a.x])
    dim: Any = g.rng.randint(-r, r - 1) if c < 0.7 else sorted(g.rng.sample(range(r), g.rng.randint(1, r)))
    fo, ft = getattr(ops, name), getattr(torch, name)
    return Step(name, lambda: fo(a.x, dim, keepdim=keep), lambda: ft(a.ref, dim, keepdim=keep), [a.x])


def op_softmax(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    d = g.rng.randint(-a.ref.ndim, a.ref.ndim - 1)
    return Step("softmax", lambda: ops.softmax(a.x, d), lambda: torch.softmax(a.ref, d), [a.x])


def op_norm(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1 and v.ref.dtype == torch.float32)
    if a is None:
        return None
    h = a.ref.shape[-1]
    w = g.fresh([h], partial_ok=False)
    if g.chance(0.5):
        def ref_rms():
            xf = a.ref.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.ref).to(a.ref.dtype)

        return Step("rms_norm", lambda: ops.rms_norm(a.x, w.x, epsilon=1e-5), ref_rms, [a.x, w.x])
    b = g.fresh([h], partial_ok=False)
    return Step(
        "layer_norm",
        lambda: ops.layer_norm(a.x, w.x, b.x, eps=1e-5),
        lambda: torch.nn.functional.layer_norm(a.ref, [h], w.ref, b.ref, 1e-5),
        [a.x, w.x, b.x],
    )


def op_cat(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    shape = list(a.ref.shape)
    d = g.rng.randint(-len(shape), len(shape) - 1)
    others = []
    for _ in range(g.rng.randint(1, 2)):
        s = list(shape)
        s[d] = g.rng.randint(1, 4)
        same = _pick(g, pool, lambda v: list(v.ref.shape) == s and v.ref.dtype == a.ref.dtype and v is not a)
        others.append(same if same is not None and g.chance(0.5) else g.fresh(s))
    vals = [a, *others]
    g.rng.shuffle(vals)
    xs = [v.x for v in vals]
    return Step("cat", lambda: ops.cat(xs, d), lambda: torch.cat([v.ref for v in vals], d), xs)


def op_index_select(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    d = g.rng.randint(0, a.ref.ndim - 1)
    idx = torch.randint(0, a.ref.shape[d], (g.rng.randint(1, 4),), generator=g.gen)
    return Step("index_select", lambda: ops.index_select(a.x, d, idx), lambda: torch.index_select(a.ref, d, idx), [a.x])


def op_argmax(g, pool):
    a = _pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    d = g.rng.randint(-a.ref.ndim, a.ref.ndim - 1)
    keep = g.chance(0.3)

    def expect(got):
        got = _value(got)
        # Near-ties may resolve differently after float reordering: the chosen entries must
        # hold the maximum (within tolerance) rather than match torch's index bit for bit.
        idx = got if keep else got.unsqueeze(d)
        chosen = torch.gather(a.ref, d, idx)
        best = a.ref.amax(d, keepdim=True)
        if not torch.allclose(chosen, best, rtol=1e-4, atol=1e-4 * (1 + float(best.abs().max()))):
            return f"argmax picked {chosen.flatten()[:4].tolist()} where the maximum is {best.flatten()[:4].tolist()}"
        return None

    return Step(
        "argmax", lambda: ops.argmax(a.x, d, keepdim=keep), lambda: torch.argmax(a.ref, d, keepdim=keep), [a.x],
        kind="argmax", expect=expect, keep=False,
    )


def _nonempty(sizes) -> int:
    return sum(1 for s in sizes if s)


def op_collective(g, pool):
    a = _pick(g, pool)
    x, r = a.x, a.ref
    n = x.shard_count if isinstance(x, ShardedTensor) else len(g.devices())
    devs = g.devices() if not isinstance(x, ShardedTensor) else g.rng.choice([x.devices, g.groups[1], g.groups[2]])
    pinned = g.chance(0.3)
    d = g.rng.randint(0, max(r.ndim - 1, 0))
    name = g.rng.choice(
        ["all_gather", "all_reduce", "reduce_scatter", "reshard_split", "replicate", "reshard", "unshard",
         "sharded_cat", "sharded_sum", "transfer", "reshard_like"]
    )
    same = lambda: r  # noqa: E731  (a collective keeps the value)

    def is_(cls, devices=None, pin=None, dim=None):
        def expect(got):
            if not isinstance(got, cls):
                return f"{name} returned {type(got).__name__}, expected {cls.__name__}"
            if devices is not None and got.devices != tuple(devices):
                return f"{name} result on {got.devices}, expected {tuple(devices)}"
            if pin is not None and got.pinned != pin:
                return f"{name} result pinned={got.pinned}, expected {pin}"
            if dim is not None and got.shard_dim != dim:
                return f"{name} result split on {got.shard_dim}, expected {dim}"
            return None

        return expect

    if name == "all_gather":
        count = lambda: (n - 1) * _nonempty(x.shard_sizes) if isinstance(x, SplitPrimitiveTensor) else 0  # noqa: E731
        return Step(name, lambda: ops.all_gather(x), same, [x], "collective",
                    is_(ReplicatedTensor, getattr(x, "devices", None), getattr(x, "pinned", None)), count)
    if name == "all_reduce":
        def count():
            if not isinstance(x, UnreducedTensor) or n == 1:
                return 0
            if n == 2:  # a swap of whole shards
                return 2 if r.numel() else 0
            return 2 * (n - 1) * _nonempty(split_sizes(r.numel(), n))

        return Step(name, lambda: ops.all_reduce(x), same, [x], "collective",
                    is_(ReplicatedTensor, getattr(x, "devices", None), getattr(x, "pinned", None)), count)
    if name == "reduce_scatter" and r.ndim:
        count = lambda: (n - 1) * _nonempty(split_sizes(r.shape[d], n))  # noqa: E731
        return Step(name, lambda: ops.reduce_scatter(x, d), same, [x], "collective",
                    is_(SplitPrimitiveTensor, getattr(x, "devices", None), getattr(x, "pinned", None), d), count)
    if name in ("reshard_split", "reshard") and r.ndim:
        if name == "reshard":
            call = lambda: ops.reshard(x, ShardingSpec.split(d, devices=devs, pinned=pinned))  # noqa: E731
        else:
            call = lambda: ops.reshard_split(x, dim=d, devices=devs, pinned=pinned)  # noqa: E731
        return Step(name, call, same, [x], "collective", is_(SplitPrimitiveTensor, devs, pinned, d))
    if name == "replicate":
        return Step(name, lambda: ops.replicate(x, devices=devs, pinned=pinned), same, [x], "collective",
                    is_(ReplicatedTensor, devs, pinned))
    if name == "reshard_like":
        like = _pick(g, pool, lambda v: isinstance(v.x, ShardedTensor) and not isinstance(v.x, UnreducedTensor) and v.ref.ndim == r.ndim)
        if like is None:
            return None
        cls = type(like.x)
        return Step(name, lambda: ops.reshard_like(x, like.x), same, [x], "collective",
                    is_(cls, like.x.devices, like.x.pinned, getattr(like.x, "shard_dim", None)))
    if name == "transfer" and isinstance(x, ShardedTensor):
        target = tuple(g.rng.sample(range(16), n)) if g.chance(0.7) else devs
        moves = sum(1 for s, t in zip(x.devices, target) if s != t)
        return Step(name, lambda: ops.transfer_to_logical_device(x, target), same, [x], "collective",
                    is_(type(x), target, x.pinned), (lambda: moves) if len(target) == n else None)
    fn = {"unshard": ops.unshard, "sharded_cat": ops.sharded_cat, "sharded_sum": ops.sharded_sum}.get(name, ops.unshard)
    return Step(fn.__name__, lambda: fn(x), same, [x], "collective", is_(torch.Tensor), keep=True)


def op_relabel(g, pool):
    """Not an op: claim a value lives elsewhere or flip its pinned flag (no data moves), so that
    later ops meet operands on different devices."""
    a = _pick(g, pool, lambda v: isinstance(v.x, ShardedTensor))
    if a is None:
        return None
    n = a.x.shard_count
    devices = a.x.devices
    if g.chance(0.6):
        cands = [grp for grp in g.groups if len(grp) == n] + [tuple(g.rng.sample(range(16), n))]
        devices = g.rng.choice(cands)
    pool.append(Value(a.x.clone(devices=devices, pinned=g.chance(0.4)), a.ref))
    return None


OPS: list[tuple[Callable, float]] = [
    (op_binary, 4),
    (op_unary, 1.5),
    (op_matmul, 2),
    (op_linear, 1.5),
    (op_reshape, 2),
    (op_layout, 1.5),
    (op_reduce, 1.5),
    (op_softmax, 1),
    (op_norm, 1),
    (op_cat, 1.5),
    (op_index_select, 0.5),
    (op_argmax, 0.7),
    (op_collective, 3),
    (op_relabel, 1),
]


# --- checks ----------------------------------------------------------------------------------


def _placement(operands: list) -> tuple[str, tuple | None, int, bool]:
    """What the placement rule says for these operands: ("ok", devices, shards moved, pinned)
    or ("error", None, 0, False). Devices is None when no operand is sharded."""
    ts, seen = [], set()
    for o in operands:
        if isinstance(o, ShardedTensor) and id(o) not in seen:
            seen.add(id(o))
            ts.append(o)
    if not ts:
        return "ok", None, 0, False
    pinned_all = all(t.pinned for t in ts)
    if len({t.devices for t in ts}) == 1:
        return "ok", ts[0].devices, 0, pinned_all
    pins = [t for t in ts if t.pinned]
    if not pins or len({t.devices for t in pins}) > 1:
        return "error", None, 0, False
    target = pins[0].devices
    moved = 0
    for t in ts:
        if t.devices != target:
            if t.shard_count != len(target):
                return "error", None, 0, False
            moved += sum(1 for s, d in zip(t.devices, target) if s != d)
    return "ok", target, moved, pinned_all


def _consistency(x: ShardedTensor) -> str | None:
    if len(x.devices) != x.shard_count or len(set(x.devices)) != x.shard_count:
        return f"devices {x.devices} for {x.shard_count} shards"
    if isinstance(x, SplitPrimitiveTensor):
        d = x.shard_dim
        for s in x.shards:
            if s.ndim != x.ndim or list(s.shape[:d]) + list(s.shape[d + 1 :]) != list(x.shape[:d]) + list(x.shape[d + 1 :]):
                return f"split shard {list(s.shape)} does not fit global {list(x.shape)} split on {d}"
        if sum(s.shape[d] for s in x.shards) != x.shape[d]:
            return f"split sizes {x.shard_sizes} do not add up to {x.shape[d]}"
    else:
        for s in x.shards:
            if s.shape != x.shape:
                return f"{type(x).__name__} shard {list(s.shape)} is not the global shape {list(x.shape)}"
        if isinstance(x, ReplicatedTensor):
            for i, s in enumerate(x.shards[1:], 1):
                if not torch.equal(s, x.shards[0]):
                    return f"replica {i} differs from replica 0 by {float((s - x.shards[0]).abs().max()):.3g}"
    return None


def _value(x) -> torch.Tensor:
    if isinstance(x, SplitPrimitiveTensor):
        return torch.cat(x.shards, dim=x.shard_dim)
    if isinstance(x, ReplicatedTensor):
        return x.shards[0]
    if isinstance(x, UnreducedTensor):
        return sum(x.shards[1:], x.shards[0])
    return x


def _compare(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, torch gives {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, torch gives {want.dtype}"
    if not want.is_floating_point():
        return None if torch.equal(got, want) else "integer values differ"
    scale = 1.0 + (float(want.abs().max()) if want.numel() else 0.0)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale, equal_nan=True):
        return f"values differ from torch by {float((got - want).abs().max()):.3g} (scale {scale:.3g})"
    return None


def _check_step(step: Step, rule, got, want, log) -> str | None:
    status, devices, moved, pinned = rule
    if step.kind in ("compute", "argmax"):
        if status == "error":
            return "the placement rule refuses these operands, but the op ran"
        if isinstance(got, ShardedTensor):
            if got.devices != devices:
                return f"result on {got.devices}, the placement rule says {devices}"
            if got.pinned != pinned:
                return f"result pinned={got.pinned}, expected {pinned} (pinned iff every operand is)"
        elif devices is not None and not isinstance(got, torch.Tensor):
            return f"returned {type(got).__name__}"
        if step.kind == "compute" and len(log) != moved:
            return f"{len(log)} transfers, the placement rule moves {moved} shards"
    if step.transfers is not None and len(log) != step.transfers():
        return f"{len(log)} transfers, expected {step.transfers()}"
    if step.expect is not None:
        msg = step.expect(got)
        if msg:
            return msg
    if isinstance(got, ShardedTensor):
        msg = _consistency(got)
        if msg:
            return msg
    elif not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__}"
    if step.name == "argmax":
        return None
    return _compare(_value(got), want)


def _check_refusal(step: Step, rule, e: Exception) -> str | None:
    if step.kind in ("compute", "argmax"):
        if isinstance(e, ops.PlacementError) and rule[0] != "error":
            return f"PlacementError although the placement rule allows these operands: {e}"
        if rule[0] == "error" and not isinstance(e, (ops.PlacementError, ops.NoImplementationError)):
            # The rule runs right after the implementation is chosen: it must be what refuses.
            return f"{type(e).__name__} where the placement rule should refuse first: {e}"
        if "ops." not in str(e):
            return f"{type(e).__name__} does not name the op: {e}"
    if not str(e):
        return f"{type(e).__name__} with an empty message"
    return None


def _describe(x) -> str:
    if isinstance(x, ShardedTensor):
        return repr(x)
    if isinstance(x, torch.Tensor):
        return f"Tensor{list(x.shape)}"
    return repr(x)


def run_sequence(seed: int, steps: int | None = None) -> Outcome:
    """Run the sequence of ``seed`` (its length drawn from the seed unless given)."""
    g = _Gen(seed)
    out = Outcome(seed)
    pool: list[Value] = [g.fresh(g.shape()) for _ in range(g.rng.randint(1, 2))]
    builders, weights = zip(*OPS)
    for i in range(steps if steps is not None else g.rng.randint(4, 12)):
        builder = g.rng.choices(builders, weights)[0]
        try:
            step = builder(g, pool)
        except Exception as e:  # a bug in this generator, not in sharktank
            raise RuntimeError(f"seed {seed} step {i}: generator {builder.__name__} failed: {e}") from e
        if step is None:
            continue
        try:
            want = step.ref()
        except (RuntimeError, ValueError, IndexError, TypeError):
            out.skipped += 1
            continue  # not a valid torch program: nothing to compare
        rule = _placement(step.operands)
        where = f"seed {seed} step {i} {step.name}({', '.join(_describe(o) for o in step.operands)})"
        out.ops += 1
        out.per_op[step.name] += 1
        try:
            with ops.record_transfers() as log:
                got = step.call()
        except REFUSALS as e:
            out.refused[type(e).__name__] += 1
            msg = _check_refusal(step, rule, e)
            if msg:
                out.failures.append(f"{where}: {msg}")
            continue
        except Exception as e:
            out.failures.append(f"{where}: raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
            continue
        msg = _check_step(step, rule, got, want, log)
        if msg:
            out.failures.append(f"{where}: {msg}")
            continue
        out.ok += 1
        if step.keep and isinstance(want, torch.Tensor) and want.is_floating_point() and want.numel() <= 4096 and want.ndim <= 5:
            pool.append(Value(got, want))
            if len(pool) > MAX_POOL:
                pool.pop(0)
    return out


def run_seeds(seeds) -> FuzzStats:
    stats = FuzzStats()
    for s in seeds:
        stats.add(run_sequence(s))
    return stats
