"""The op builders of the sharktank.ops fuzzer (see opfuzz.py): one function per family of ops,
each drawing operands from the pool (or fresh ones) and returning a :class:`Step` (or None when
the pool offers nothing suitable), and :data:`OPS`, the builders with the weights a sequence
draws them by."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from opfuzz_check import global_value
from opfuzz_gen import Step, Value, partner, pick
from sharktank import ops
from sharktank.types import ReplicatedTensor, ShardedTensor, ShardingSpec, SplitPrimitiveTensor, UnreducedTensor
from sharktank.types.placement import split_sizes


def op_binary(g, pool):
    a = pick(g, pool)
    name = g.rng.choice(["add", "sub", "mul", "div", "elementwise2", "operator"])
    if g.chance(0.15) and name != "elementwise2":
        s = g.rng.choice([2.0, -0.5, 3])
        fo, ft = {"add": (ops.add, torch.add), "sub": (ops.sub, torch.sub), "mul": (ops.mul, torch.mul)}.get(name, (ops.mul, torch.mul))
        if g.chance(0.5):
            return Step(f"{fo.__name__}_scalar", lambda: fo(a.x, s), lambda: ft(a.ref, s), [a.x])
        return Step(f"{fo.__name__}_scalar_lhs", lambda: fo(s, a.x), lambda: ft(s, a.ref), [a.x])
    b = partner(g, pool, list(a.ref.shape), positive=name == "div")
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
    a = pick(g, pool)
    choice = g.rng.choice(["tanh", "sigmoid", "neg", "to64", "to32"])
    if choice == "neg":
        return Step("neg", lambda: -a.x, lambda: -a.ref, [a.x])
    if choice in ("to64", "to32"):
        dt = torch.float64 if choice == "to64" else torch.float32
        return Step("to", lambda: ops.to(a.x, dt), lambda: a.ref.to(dt), [a.x])
    fn = getattr(torch, choice)
    return Step("elementwise", lambda: ops.elementwise(fn, a.x), lambda: fn(a.ref), [a.x])


def op_matmul(g, pool):
    a = pick(g, pool, lambda v: v.ref.ndim >= 2)
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
    a = pick(g, pool)
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
    a = pick(g, pool, lambda v: v.ref.ndim >= 1)
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
    a = pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    r = a.ref.ndim
    which = g.rng.choice(["transpose", "permute", "expand", "narrow", "T"])
    if which == "T" and r == 2 and isinstance(a.x, ShardedTensor):
        return Step("transpose", lambda: a.x.T, lambda: a.ref.T, [a.x])
    if which == "transpose" or r == 1 and which == "permute":
        d0, d1 = g.rng.randint(-r, r - 1), g.rng.randint(-r, r - 1)
        return Step("transpose", lambda: ops.transpose(a.x, d0, d1), lambda: a.ref.transpose(d0, d1), [a.x])
    if which == "permute":
        perm = list(range(r))
        g.rng.shuffle(perm)
        return Step("permute", lambda: ops.permute(a.x, perm), lambda: a.ref.permute(*perm), [a.x])
    if which == "narrow":
        d = g.rng.randint(-r, r - 1)
        start = g.rng.randint(0, a.ref.shape[d] - 1)  # at least one entry: later ops reduce
        length = g.rng.randint(1, a.ref.shape[d] - start)
        return Step("narrow", lambda: ops.narrow(a.x, d, start, length), lambda: a.ref.narrow(d, start, length), [a.x])
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
    a = pick(g, pool, lambda v: v.ref.ndim >= 1)
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
    a = pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    d = g.rng.randint(-a.ref.ndim, a.ref.ndim - 1)
    return Step("softmax", lambda: ops.softmax(a.x, d), lambda: torch.softmax(a.ref, d), [a.x])


def op_norm(g, pool):
    a = pick(g, pool, lambda v: v.ref.ndim >= 1 and v.ref.dtype == torch.float32)
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
    a = pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    shape = list(a.ref.shape)
    d = g.rng.randint(-len(shape), len(shape) - 1)
    others = []
    for _ in range(g.rng.randint(1, 2)):
        s = list(shape)
        s[d] = g.rng.randint(1, 4)
        same = pick(g, pool, lambda v: list(v.ref.shape) == s and v.ref.dtype == a.ref.dtype and v is not a)
        others.append(same if same is not None and g.chance(0.5) else g.fresh(s))
    vals = [a, *others]
    g.rng.shuffle(vals)
    xs = [v.x for v in vals]
    return Step("cat", lambda: ops.cat(xs, d), lambda: torch.cat([v.ref for v in vals], d), xs)


def op_index_select(g, pool):
    a = pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    d = g.rng.randint(0, a.ref.ndim - 1)
    idx = torch.randint(0, a.ref.shape[d], (g.rng.randint(1, 4),), generator=g.gen)
    return Step("index_select", lambda: ops.index_select(a.x, d, idx), lambda: torch.index_select(a.ref, d, idx), [a.x])


def op_argmax(g, pool):
    a = pick(g, pool, lambda v: v.ref.ndim >= 1)
    if a is None:
        return None
    d = g.rng.randint(-a.ref.ndim, a.ref.ndim - 1)
    keep = g.chance(0.3)

    def expect(got):
        got = global_value(got)
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
    a = pick(g, pool)
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
        like = pick(g, pool, lambda v: isinstance(v.x, ShardedTensor) and not isinstance(v.x, UnreducedTensor) and v.ref.ndim == r.ndim)
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
    a = pick(g, pool, lambda v: isinstance(v.x, ShardedTensor))
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
