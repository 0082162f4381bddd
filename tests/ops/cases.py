"""Op cases for the sharded-vs-torch tests.

Each case draws shapes, returns the torch operands, how to call the sharktank op on
(placed) operands, the torch reference, and the placements that must be supported
(the rest must either match torch too or raise the documented error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from sharktank import ops


@dataclass
class Built:
    tensors: list[torch.Tensor]
    call: Callable
    ref: Callable
    required: list[tuple[str, ...]] = field(default_factory=list)
    no_partial: tuple[int, ...] = ()  # operand positions that may not be unreduced (ints)
    atol: float = 1e-4
    takes_devices: bool = False  # call(*operands, devices=...): ops that place a plain operand


def _rand(gen, *shape, dtype=torch.float32):
    return torch.randn(tuple(shape), generator=gen, dtype=dtype)


dims = st.integers(1, 9)


def shape_of(draw, rank_min=1, rank_max=4):
    return [draw(dims) for _ in range(draw(st.integers(rank_min, rank_max)))]


def case_binary(fn_ops, fn_torch, positive_rhs=False):
    def build(draw, gen):
        a_shape = shape_of(draw)
        k = draw(st.integers(0, len(a_shape)))
        b_shape = [1 if draw(st.booleans()) and i > 0 else s for i, s in enumerate(a_shape[len(a_shape) - k :])]
        if draw(st.booleans()):
            a_shape, b_shape = b_shape, a_shape
        a, b = _rand(gen, *a_shape), _rand(gen, *b_shape)
        if positive_rhs:
            b = b.abs() + 0.5
        r = max(len(a_shape), len(b_shape))
        req = [("R", "R"), ("R", "T"), ("T", "R")]
        if len(a_shape) == len(b_shape) == r and r > 0 and a_shape == b_shape:
            req += [("S0", "S0"), ("S0", "R")]
        return Built([a, b], fn_ops, fn_torch, req)

    return build


def case_scalar(fn_ops, fn_torch):
    def build(draw, gen):
        s = draw(st.sampled_from([2.0, -0.5, 3]))
        return Built([_rand(gen, *shape_of(draw))], lambda x: fn_ops(x, s), lambda x: fn_torch(x, s), [("R",), ("S0",)])

    return build


def case_elementwise(draw, gen):
    shape = shape_of(draw)
    a, b = _rand(gen, *shape), _rand(gen, *shape)
    fn = lambda x, y: torch.tanh(x) * y + x  # noqa: E731
    return Built([a, b], lambda x, y: ops.elementwise(fn, x, y), fn, [("R", "R"), ("S0", "S0"), ("S0", "T")])


def case_matmul(draw, gen):
    m, k, n = draw(dims), draw(dims), draw(dims)
    batch = [draw(dims) for _ in range(draw(st.integers(0, 2)))]
    a_shape = batch + [m, k]
    rhs_batched = bool(batch) and draw(st.booleans())
    b_shape = (batch if rhs_batched else []) + [k, n]
    t = draw(st.booleans())
    if t:
        b_shape = b_shape[:-2] + [n, k]
    a, b = _rand(gen, *a_shape), _rand(gen, *b_shape)
    ra, rb = len(a_shape), len(b_shape)
    kb, nb = (rb - 1, rb - 2) if t else (rb - 2, rb - 1)
    req = [
        ("R", "R"),
        (f"S{ra - 2}", "R"),
        ("R", f"S{nb}"),
        (f"S{ra - 1}", f"S{kb}"),
        (f"S{ra - 1}", "T"),
        ("P", "R"),
        ("R", "P"),
    ]
    return Built(
        [a, b],
        lambda x, y: ops.matmul(x, y, transpose_rhs=t),
        lambda x, y: torch.matmul(x, y.mT if t else y),
        req,
        atol=1e-3,
    )


def case_linear(draw, gen):
    k, n = draw(dims), draw(dims)
    x_shape = [draw(dims) for _ in range(draw(st.integers(1, 2)))] + [k]
    x, w, b = _rand(gen, *x_shape), _rand(gen, n, k), _rand(gen, n)
    last = len(x_shape) - 1
    req = [("R", "S0", "S0"), ("R", "S0", "R"), (f"S{last}", "S1", "R"), (f"S{last}", "S1", "T"), ("T", "R", "T")]
    if len(x_shape) > 1:
        req.append(("S0", "R", "R"))
    return Built([x, w, b], lambda x_, w_, b_: ops.linear(x_, w_, b_), F.linear, req, atol=1e-3)


def case_softmax(draw, gen):
    shape = shape_of(draw)
    d = draw(st.integers(0, len(shape) - 1))
    req = [("R",)] + [(f"S{i}",) for i in range(len(shape)) if i != d]
    return Built([_rand(gen, *shape)], lambda x: ops.softmax(x, d), lambda x: torch.softmax(x, d), req)


def case_rms_norm(draw, gen):
    shape = shape_of(draw, 2)
    x, w = _rand(gen, *shape), _rand(gen, shape[-1])
    return Built(
        [x, w],
        lambda x_, w_: ops.rms_norm(x_, w_, epsilon=1e-5),
        lambda x_, w_: x_ * torch.rsqrt(x_.pow(2).mean(-1, keepdim=True) + 1e-5) * w_,
        [("S0", "R"), ("R", "T"), ("S0", "T")],
        atol=1e-3,
    )


def case_layer_norm(draw, gen):
    shape = shape_of(draw, 2)
    x, w, b = _rand(gen, *shape), _rand(gen, shape[-1]), _rand(gen, shape[-1])
    return Built(
        [x, w, b],
        lambda x_, w_, b_: ops.layer_norm(x_, w_, b_, eps=1e-5),
        lambda x_, w_, b_: F.layer_norm(x_, [shape[-1]], w_, b_, 1e-5),
        [("S0", "R", "R"), ("R", "T", "T")],
        atol=1e-3,
    )


def case_sdpa(draw, gen):
    b, h, lq, lk, e = (draw(st.integers(1, 4)) for _ in range(5))
    q, k, v = _rand(gen, b, h, lq, e), _rand(gen, b, h, lk, e), _rand(gen, b, h, lk, e)
    return Built(
        [q, k, v],
        lambda q_, k_, v_: ops.scaled_dot_product_attention(q_, k_, v_),
        lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_),
        [("S1", "S1", "S1"), ("S0", "S0", "S0"), ("R", "R", "R")],
        atol=1e-3,
    )


def case_sdpa_gqa(draw, gen):
    b, kv, groups, lq, lk, e = (draw(st.integers(1, 3)) for _ in range(6))
    q = _rand(gen, b, kv * groups, lq, e)
    k, v = _rand(gen, b, kv, lk, e), _rand(gen, b, kv, lk, e)
    mask = torch.rand((lq, lk), generator=gen) > 0.3
    mask[:, 0] = True
    return Built(
        [q, k, v, mask],
        lambda q_, k_, v_, m: ops.scaled_dot_product_attention(q_, k_, v_, m, enable_gqa=True),
        lambda q_, k_, v_, m: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=m, enable_gqa=True),
        [("R", "R", "R", "T"), ("R", "R", "R", "R")],
        no_partial=(3,),
        atol=1e-3,
    )


def case_paged_attention(draw, gen):
    # The table and mask are fixed (plain): the drawn placements are q's and the pools'.
    b, kv, groups, e, l = (draw(st.integers(1, 3)) for _ in range(5))
    n, m = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    p = draw(st.integers(1, 2 * b * m))
    q, k_pool, v_pool = _rand(gen, b, kv * groups, l, e), _rand(gen, p, n, kv, e), _rand(gen, p, n, kv, e)
    pages = torch.randint(0, p, (b, m), generator=gen)
    mask = torch.rand((b, 1, l, m * n), generator=gen) > 0.3
    mask[..., 0] = True

    def ref(q_, k_, v_):
        k_, v_ = (pool[pages].reshape(b, m * n, kv, e).transpose(1, 2) for pool in (k_, v_))
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True)

    return Built(
        [q, k_pool, v_pool],
        lambda q_, k_, v_: ops.paged_attention(q_, k_, v_, pages, mask, enable_gqa=True),
        ref,
        [("T", "T", "T"), ("R", "R", "R"), ("T", "R", "R")],
        no_partial=(1, 2),  # caches are never partial sums (an unreduced q is drawn, and refused)
        atol=1e-3,
    )


def case_index_put(draw, gen):
    bsz, t, h, d = (draw(dims) for _ in range(4))
    s = draw(st.integers(1, t))
    cache, new = _rand(gen, bsz, t, h, d), _rand(gen, bsz, s, h, d)
    start = torch.randint(0, t - s + 1, (bsz,), generator=gen)
    rows = torch.arange(bsz)[:, None].expand(bsz, s)
    cols = start[:, None] + torch.arange(s)[None, :]
    return Built(
        [cache, new],
        lambda c, v: ops.index_put(c, [rows, cols], v),
        lambda c, v: c.index_put((rows, cols), v),
        [("S2", "S2"), ("S3", "S3"), ("R", "R"), ("R", "T")],
    )


def case_embedding(draw, gen):
    vocab, dim = draw(dims), draw(dims)
    ids = torch.randint(0, vocab, (draw(dims), draw(dims)), generator=gen)
    w = _rand(gen, vocab, dim)
    return Built(
        [ids, w],
        lambda i, w_: ops.embedding_lookup(i, w_),
        F.embedding,
        [("R", "R"), ("S0", "R"), ("R", "S1"), ("R", "S0"), ("T", "S0")],
        no_partial=(0,),
    )


def case_index_select(draw, gen):
    shape = shape_of(draw)
    d = draw(st.integers(0, len(shape) - 1))
    idx = torch.randint(0, shape[d], (draw(dims),), generator=gen)
    req = [("R", "R"), ("R", "T")] + [(f"S{i}", "T") for i in range(len(shape)) if i != d]
    return Built(
        [_rand(gen, *shape), idx],
        lambda t, i: ops.index_select(t, d, i),
        lambda t, i: torch.index_select(t, d, i),
        req,
        no_partial=(1,),
    )


def case_take_along_dim(draw, gen):
    shape = shape_of(draw)
    d = draw(st.integers(0, len(shape) - 1))
    # The index's other dims broadcast (1) or match; dim d takes any count of positions.
    ishape = [draw(dims) if i == d else (1 if draw(st.booleans()) else s) for i, s in enumerate(shape)]
    idx = torch.randint(0, shape[d], tuple(ishape), generator=gen)
    req = [("R", "R"), ("R", "T")] + [(f"S{i}", "T") for i in range(len(shape)) if i != d and ishape[i] == 1]
    return Built(
        [_rand(gen, *shape), idx],
        lambda t, i: ops.take_along_dim(t, i, d),
        lambda t, i: torch.take_along_dim(t, i, d),
        req,
        no_partial=(1,),
    )


def case_reduce(name):
    def build(draw, gen):
        shape = shape_of(draw)
        d = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
        keep = draw(st.booleans())
        fo, ft = getattr(ops, name), getattr(torch, name)
        call = (lambda x: fo(x)) if d is None else (lambda x: fo(x, d, keepdim=keep))
        ref = (lambda x: ft(x)) if d is None else (lambda x: ft(x, d, keepdim=keep))
        return Built([_rand(gen, *shape)], call, ref, [("R",), ("P",)] + [(f"S{i}",) for i in range(len(shape))])

    return build


def case_argmax(draw, gen):
    shape = shape_of(draw)
    d = draw(st.integers(0, len(shape) - 1))
    keep = draw(st.booleans())
    return Built(
        [_rand(gen, *shape)],
        lambda x: ops.argmax(x, d, keepdim=keep),
        lambda x: torch.argmax(x, d, keepdim=keep),
        [("R",)] + [(f"S{i}",) for i in range(len(shape))],
        atol=0,
    )


def case_cat(draw, gen):
    shape = shape_of(draw)
    d = draw(st.integers(0, len(shape) - 1))
    other = list(shape)
    other[d] = draw(dims)
    req = [("R", "R"), ("P", "P"), ("R", "T")] + [(f"S{i}", f"S{i}") for i in range(len(shape)) if i != d]
    return Built(
        [_rand(gen, *shape), _rand(gen, *other)],
        lambda a, b: ops.cat([a, b], d),
        lambda a, b: torch.cat([a, b], d),
        req,
    )


def _factor(draw, n):
    divs = [x for x in range(1, n + 1) if n % x == 0]
    a = draw(st.sampled_from(divs))
    return [a, n // a]


def case_reshape(draw, gen):
    shape = shape_of(draw, 1, 3)
    # Target: merge a run of dims, or factor one dim into two.
    i = draw(st.integers(0, len(shape) - 1))
    if draw(st.booleans()) and i < len(shape) - 1:
        target = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2 :]
        req = [("R",), ("P",), (f"S{i}",)] + [(f"S{j}",) for j in range(i)]
    else:
        target = shape[:i] + _factor(draw, shape[i]) + shape[i + 1 :]
        req = [("R",), ("P",)] + [(f"S{j}",) for j in range(len(shape)) if j != i]
    use_view = draw(st.booleans())
    fo = ops.view if use_view else ops.reshape
    return Built([_rand(gen, *shape)], lambda x: fo(x, target), lambda x: x.reshape(target), req)


def case_flatten(draw, gen):
    shape = shape_of(draw, 2, 4)
    a = draw(st.integers(0, len(shape) - 1))
    b = draw(st.integers(a, len(shape) - 1))
    return Built(
        [_rand(gen, *shape)],
        lambda x: ops.flatten(x, a, b),
        lambda x: torch.flatten(x, a, b),
        [("R",), ("P",), (f"S{a}",)] + [(f"S{j}",) for j in range(len(shape)) if j < a or j > b],
    )


def case_unflatten(draw, gen):
    shape = shape_of(draw, 1, 3)
    d = draw(st.integers(0, len(shape) - 1))
    sizes = _factor(draw, shape[d])
    return Built(
        [_rand(gen, *shape)],
        lambda x: ops.unflatten(x, d, sizes),
        lambda x: torch.unflatten(x, d, sizes),
        [("R",), ("P",)] + [(f"S{j}",) for j in range(len(shape)) if j != d],
    )


def case_transpose(draw, gen):
    shape = shape_of(draw, 2)
    a, b = draw(st.integers(0, len(shape) - 1)), draw(st.integers(0, len(shape) - 1))
    return Built(
        [_rand(gen, *shape)],
        lambda x: ops.transpose(x, a, b),
        lambda x: x.transpose(a, b),
        [("R",), ("P",)] + [(f"S{j}",) for j in range(len(shape))],
    )


def case_permute(draw, gen):
    shape = shape_of(draw, 1)
    perm = draw(st.permutations(range(len(shape))))
    return Built(
        [_rand(gen, *shape)],
        lambda x: ops.permute(x, perm),
        lambda x: x.permute(*perm),
        [("R",), ("P",)] + [(f"S{j}",) for j in range(len(shape))],
    )


def case_expand(draw, gen):
    shape = shape_of(draw, 2)
    one = draw(st.integers(0, len(shape) - 1))
    src = list(shape)
    src[one] = 1
    return Built(
        [_rand(gen, *src)],
        lambda x: ops.expand(x, shape),
        lambda x: x.expand(*shape),
        [("R",), ("P",)] + [(f"S{j}",) for j in range(len(shape)) if j != one],
    )


def case_to(draw, gen):
    return Built(
        [_rand(gen, *shape_of(draw))],
        lambda x: ops.to(x, torch.float64),
        lambda x: x.to(torch.float64),
        [("R",), ("P",), ("S0",)],
    )


def case_collective(name):
    def build(draw, gen):
        shape = shape_of(draw)
        d = draw(st.integers(0, len(shape) - 1))
        calls = {
            "all_gather": (lambda x: ops.all_gather(x), [(f"S{j}",) for j in range(len(shape))] + [("R",)]),
            "all_reduce": (lambda x: ops.all_reduce(x), [("P",), ("R",)]),
            "reduce_scatter": (lambda x: ops.reduce_scatter(x, d), [("P",)]),
            "replicate": (lambda x, devices: ops.replicate(x, devices=devices), [("P",), ("R",), ("T",), (f"S{d}",)]),
            "reshard_split": (lambda x, devices: ops.reshard_split(x, dim=d, devices=devices), [("P",), ("R",), ("T",)] + [(f"S{j}",) for j in range(len(shape))]),
            "unshard": (lambda x: ops.unshard(x), [("P",), ("R",), ("T",)] + [(f"S{j}",) for j in range(len(shape))]),
            "sharded_cat": (lambda x: ops.sharded_cat(x), [(f"S{j}",) for j in range(len(shape))]),
            "sharded_sum": (lambda x: ops.sharded_sum(x), [("P",)]),
        }
        call, req = calls[name]
        return Built([_rand(gen, *shape)], call, lambda x: x, req, takes_devices=name in ("replicate", "reshard_split"))

    return build


CASES: dict[str, Callable] = {
    "add": case_binary(ops.add, torch.add),
    "sub": case_binary(ops.sub, torch.sub),
    "mul": case_binary(ops.mul, torch.mul),
    "div": case_binary(ops.div, torch.div, positive_rhs=True),
    "add_scalar": case_scalar(ops.add, torch.add),
    "mul_scalar": case_scalar(ops.mul, torch.mul),
    "elementwise": case_elementwise,
    "matmul": case_matmul,
    "linear": case_linear,
    "softmax": case_softmax,
    "rms_norm": case_rms_norm,
    "layer_norm": case_layer_norm,
    "scaled_dot_product_attention": case_sdpa,
    "embedding_lookup": case_embedding,
    "sdpa_gqa": case_sdpa_gqa,
    "paged_attention": case_paged_attention,
    "index_put": case_index_put,
    "index_select": case_index_select,
    "take_along_dim": case_take_along_dim,
    "sum": case_reduce("sum"),
    "mean": case_reduce("mean"),
    "argmax": case_argmax,
    "cat": case_cat,
    "reshape": case_reshape,
    "flatten": case_flatten,
    "unflatten": case_unflatten,
    "transpose": case_transpose,
    "permute": case_permute,
    "expand": case_expand,
    "to": case_to,
    **{c: case_collective(c) for c in ("all_gather", "all_reduce", "reduce_scatter", "replicate", "reshard_split", "unshard", "sharded_cat", "sharded_sum")},
}

