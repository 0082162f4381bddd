"""Every op, every placement of its operands, against unsharded torch.

Each example draws one combination from the op's valid ones (kinds that fit the operands'
ranks and dtypes, at least one operand sharded unless the combination is required). The op
must equal the torch result, with the result on the operands' devices, or refuse with the
documented error (ShardingError, NoImplementationError) for one of the reasons REFUSALS
lists for it; a refusal is then rejected with ``assume``, so each counted example compared
values. The placements each op must support are also run one by one.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from cases import CASES, Built
from placing import device_tuples, kinds_for, place
from sharktank import ops
from sharktank.types import ShardedTensor, UnreducedTensor

REFUSAL_TYPES = (ops.ShardingError, ops.NoImplementationError)


# Why each op may refuse a drawn combination: regexes on the message, which must also start
# with the op's name. Any other refusal fails, so a new one is added here with its reason.
_ALONG_SPLIT = r"along dim \d+ of \[[\d, ]*\], which is split \[[\d, ]*\]; all_gather or reshard first"
_NOT_LINEAR = r" is not linear,? and (got an|an operand is an) UnreducedTensor"
_DISAGREE = r": split operands disagree: "
_BINARY = [_DISAGREE, r": cannot mix split and unreduced operands", r": an operand of size \d+ along the split dim broadcasts against a split dim", _NOT_LINEAR]
_NO_LOCAL = r": no local computation for lhs \w+Tensor \S+ shape \[[\d, ]*\] with rhs \w+Tensor \S+ shape \[[\d, ]*\]"
_NO_IMPL = r" has no implementation for \((Split\w+|Replicated|Unreduced)Tensor\); registered: "
REFUSALS: dict[str, tuple[str, list[str]]] = {  # case -> (op named in the message, reasons)
    **{op: (op, _BINARY) for op in ("add", "sub", "mul", "div")},
    "add_scalar": ("add", []),
    "mul_scalar": ("mul", []),
    "elementwise": (r"elementwise\(<lambda>\)", _BINARY),
    "matmul": ("matmul", [_NO_LOCAL, _NOT_LINEAR]),
    "linear": ("linear", [_NO_LOCAL, r": the result is unreduced but the bias is split", r": bias .* is split but the output is not split on its last dim",
                          r": an unreduced bias is not supported", r": bias split \[[\d, ]*\] does not match the output split"]),
    **{op: (op, [" works " + _ALONG_SPLIT, _NOT_LINEAR]) for op in ("softmax", "rms_norm", "layer_norm")},
    "scaled_dot_product_attention": ("scaled_dot_product_attention", [" works " + _ALONG_SPLIT, _DISAGREE, _NOT_LINEAR]),
    "sdpa_gqa": ("scaled_dot_product_attention", [r" with GQA needs q, k and v split on the head dim \(-3\); [qkv] is ", r": q heads split \[[\d, ]*\] do not line up with kv heads split",
                                                  r" with GQA takes a replicated or plain mask", " works " + _ALONG_SPLIT, _DISAGREE, _NOT_LINEAR]),
    "paged_attention": ("paged_attention", [r" takes q split on its heads \(dim 1\) and both pools on their KV heads \(dim 2\), or none of them split; found q ",
                                            r": q heads of \[[\d, ]*\] split \[[\d, ]*\] do not line up with the pools' KV heads", _NOT_LINEAR]),
    "index_put": ("index_put", [r": indexed dim \d+ of \[[\d, ]*\] is split; reshard first", r": values .* must be split like ", r": replicated target with .* values",
                                r": a plain tensor cannot take sharded indices or values", r" into an UnreducedTensor is not linear"]),
    "index_select": ("index_select", [" " + _ALONG_SPLIT, r": index tensors must be replicated or plain, found "]),
    "take_along_dim": ("take_along_dim", [r" along dim \d+ of \[[\d, ]*\] \(split \[[\d, ]*\] on dim \d+\) with an index of shape \[[\d, ]*\]: the split dim must be another one",
                                          r": index tensors must be replicated or plain, found ", r" of an UnreducedTensor .*: all_reduce first"]),
    "embedding_lookup": ("embedding_lookup", [r": split ids with a split embedding matrix", r": unreduced operands are not supported"]),
    **{op: (op, []) for op in ("sum", "mean", "argmax", "transpose", "permute", "to", "replicate", "reshard_split", "unshard")},
    "cat": ("cat", [r" along the split dim \d+ interleaves shards", r": split operands disagree: S\(\d+\) ", r": unreduced tensors can only be concatenated with unreduced"]),
    **{op: ("reshape", [r": reshape \[[\d, ]*\] -> \[[\d, ]*\] \(split dim \d+.*\) moves items between shards"]) for op in ("reshape", "flatten")},
    "unflatten": ("unflatten", [r": dim \d+ of \[[\d, ]*\] split in sizes \[[\d, ]*\] cannot become \[[\d, ]*\] without moving items between shards"]),
    "expand": ("expand", [r": cannot expand split dim \d+ of \[[\d, ]*\] to "]),
    **{op: (op, [_NO_IMPL]) for op in ("all_gather", "all_reduce", "reduce_scatter", "sharded_cat", "sharded_sum")},
}

# Least share of an op's drawn combinations that must compare values (the rest refused):
# a guard against draws drifting to refusals only. Hypothesis already makes every op compare
# values in max_examples examples; sdpa_gqa, whose q, k and v must all be split on heads,
# compares in 5-7 % of its draws and the count moves between runs (paged_attention, whose q
# and pools must be split together or not at all, in about 3 %), so the floor is 2 %.
MIN_COMPARED_SHARE = 0.02


def _refusal_ok(name: str, kinds, e: Exception) -> None:
    """A refusal of the documented type (NoImplementationError for a missing rule, else
    ShardingError) for a reason REFUSALS lists for this op."""
    op, reasons = REFUSALS[name]
    typed = [r for r in reasons if isinstance(e, ops.NoImplementationError if r == _NO_IMPL else ops.ShardingError)]
    assert any(re.match(rf"ops\.({op}){r}", str(e), re.S) for r in typed), f"{name} {kinds}: unlisted refusal {type(e).__name__}: {e}"


def _value(x):
    return ops.unshard(x) if isinstance(x, ShardedTensor) else x


def _check(b: Built, kinds, devices, gen):
    placed = [place(t, k, devices, gen=gen) for t, k in zip(b.tensors, kinds)]
    expected = b.ref(*b.tensors)
    got = b.call(*placed, devices=devices) if b.takes_devices else b.call(*placed)
    if isinstance(got, ShardedTensor):
        assert got.devices == devices, f"result on {got.devices}, operands on {devices}"
        assert not got.pinned
    got = _value(got)
    assert got.shape == expected.shape, f"{kinds}: shape {list(got.shape)} != {list(expected.shape)}"
    assert got.dtype == expected.dtype
    if b.atol == 0:
        assert torch.equal(got, expected), kinds
    else:
        torch.testing.assert_close(got, expected, atol=b.atol, rtol=1e-4, msg=lambda m: f"{kinds}: {m}")


def _kind_ok(b: Built, i: int, k: str) -> bool:
    t = b.tensors[i]
    if k == "P":
        return i not in b.no_partial and t.is_floating_point()
    return not k.startswith("S") or int(k[1:]) < t.ndim


def valid_kinds(b: Built) -> list[tuple[str, ...]]:
    """The combinations worth running: each kind fits its operand, and at least one operand is
    sharded unless the combination is required (plain input to replicate, say)."""
    per = [[k for k in kinds_for(t.ndim) if _kind_ok(b, i, k)] for i, t in enumerate(b.tensors)]
    return [c for c in itertools.product(*per) if any(k != "T" for k in c) or c in b.required]


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_torch_or_refuses(name, record_property):
    tally = Counter()

    # A refusal is checked, then rejected: hypothesis draws on until max_examples compared.
    @settings(suppress_health_check=[HealthCheck.filter_too_much])
    @given(data=st.data())
    def one(data):
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        b = CASES[name](data.draw, gen)
        devices = data.draw(device_tuples(1, 8))
        kinds = data.draw(st.sampled_from(valid_kinds(b)))
        try:
            _check(b, kinds, devices, gen)
        except REFUSAL_TYPES as e:
            assert kinds not in b.required, f"{name} must support {kinds}: {e}"
            _refusal_ok(name, kinds, e)
            tally["refused"] += 1
            assume(False)
        tally["compared"] += 1

    one()
    compared, drawn = tally["compared"], tally["compared"] + tally["refused"]
    print(f"ops vs torch, {name}: compared {compared} of {drawn} drawn")
    record_property("reliability:ops vs torch, examples compared", {name: compared})
    record_property("reliability:ops vs torch, refusals checked", {name: tally["refused"]})
    assert compared >= settings().max_examples, f"{name}: only {compared} examples compared ({drawn} drawn)"
    assert compared >= MIN_COMPARED_SHARE * drawn, f"{name}: {compared} of {drawn} drawn compared values"


@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_required_placements_work(name, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    b = CASES[name](data.draw, gen)
    devices = data.draw(device_tuples(1, 8))
    required = [k for k in b.required if all(_kind_ok(b, i, x) for i, x in enumerate(k))]
    assert required or all(t.ndim == 0 for t in b.tensors)
    assert set(required) <= set(valid_kinds(b)), "a required combination the draws never reach"
    for kinds in required:
        _check(b, kinds, devices, gen)


def test_unreduced_refused_by_nonlinear_ops():
    u = place(torch.randn(4, 6), "P", (0, 1, 2))
    for fn in (lambda: ops.elementwise(torch.exp, u), lambda: ops.softmax(u, 1), lambda: ops.mul(u, u)):
        with pytest.raises(ops.ShardingError, match="all_reduce"):
            fn()
    assert isinstance(ops.mul(u, 2.0), UnreducedTensor)


def test_broadcasting_a_split_dim_is_refused_not_wrong():
    # Found by the thorough hypothesis profile: a split dim of size 1 broadcast against 2.
    a = place(torch.randn(1, 1), "S1", (0,))
    with pytest.raises(ops.ShardingError, match="broadcasts against a split dim"):
        ops.add(a, torch.randn(1, 2))
    b = place(torch.randn(1, 3, 4), "S0", (0, 1))
    with pytest.raises(ops.ShardingError, match="broadcasts against a split dim"):
        ops.matmul(b, torch.randn(3, 4, 2))


def test_size_one_dims_aligned_with_a_size_one_split_are_cut():
    # Found by the thorough profile: q, k plain with batch 1 and v split on its batch of 1.
    q, k, v = (torch.randn(1, 1, 1, 1) for _ in range(3))
    got = ops.scaled_dot_product_attention(q, k, place(v, "S0", (0, 1)))
    torch.testing.assert_close(ops.unshard(got), torch.nn.functional.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gqa_attention_split_on_heads(n):
    q, k, v = torch.randn(2, 8, 5, 4), torch.randn(2, 4, 5, 4), torch.randn(2, 4, 5, 4)
    devices = tuple(range(n))
    got = ops.scaled_dot_product_attention(
        *(place(t, "S1", devices) for t in (q, k, v)), is_causal=True, enable_gqa=True
    )
    assert got.shard_dim == 1 and got.devices == devices
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ops.unshard(got), want)
    if n == 4:
        with pytest.raises(ops.ShardingError, match="do not line up"):
            ops.scaled_dot_product_attention(
                place(q, "S1", (0, 1, 2)), place(k, "S1", (0, 1, 2)), place(v, "S1", (0, 1, 2)), enable_gqa=True
            )


def _paged_operands():
    g = torch.Generator().manual_seed(0)
    q, pools = torch.randn(2, 8, 1, 4, generator=g), [torch.randn(10, 4, 4, 4, generator=g).to(torch.bfloat16) for _ in range(2)]
    pages = torch.tensor([[7, 2, 5], [7, 0, 9]])  # page 7 shared
    mask = (torch.arange(12) <= torch.tensor([5, 10])[:, None])[:, None, None, :]
    return q, *pools, pages, mask


@pytest.mark.parametrize("n", [1, 2, 4])
def test_paged_attention_split_on_heads(n):
    q, k, v, pages, mask = _paged_operands()
    devices = tuple(range(n))
    got = ops.paged_attention(place(q, "S1", devices), place(k, "S2", devices), place(v, "S2", devices), place(pages, "R", devices), place(mask, "R", devices),
                              enable_gqa=True)
    assert got.shard_dim == 1 and got.devices == devices
    torch.testing.assert_close(ops.unshard(got), ops.paged_attention(q, k, v, pages, mask, enable_gqa=True))
    with pytest.raises(ops.ShardingError, match=r"takes a replicated or plain pages, found \[2, 3\] S\(0\)" if n > 1 else "takes a replicated"):
        ops.paged_attention(place(q, "S1", devices), place(k, "S2", devices), place(v, "S2", devices), place(pages, "S0", devices), mask, enable_gqa=True)
    with pytest.raises(ops.ShardingError, match=r"or none of them split; found q \[2, 8, 1, 4\] S\(1\), k_pool \[10, 4, 4, 4\] R"):
        ops.paged_attention(place(q, "S1", devices), place(k, "R", devices), place(v, "S2", devices), pages, mask, enable_gqa=True)


def test_paged_attention_is_attention_over_the_gathered_pages():
    # Its torch form is what layers.attention computed before the op: the pages gathered by
    # one index_select of the flattened pool, then scaled_dot_product_attention (bitwise).
    q, k, v, pages, mask = _paged_operands()
    flat = (pages[:, :, None] * 4 + torch.arange(4)).reshape(-1)
    k_win, v_win = (pool.flatten(0, 1).index_select(0, flat).unflatten(0, [2, 12]).transpose(1, 2) for pool in (k, v))
    want = ops.scaled_dot_product_attention(q, k_win, v_win, mask, enable_gqa=True)
    assert torch.equal(ops.paged_attention(q, k, v, pages, mask, enable_gqa=True), want)


@pytest.mark.parametrize("mask", ["none", "bool", "additive", "per_head"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("n", [1, 2])
def test_attention_as_matmuls_matches_fused(mask, heads, kv_heads, n):
    # The unfused form export traces for CPU: GQA groups stacked, never repeated; a
    # half-precision k/v computed in q's float32 as the fused path does.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 3, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 7, 8, generator=g).half() for _ in range(2))
    a = {
        "none": None,
        "bool": torch.rand(2, 1, 3, 7, generator=g) > 0.3,
        "additive": torch.randn(2, 1, 3, 7, generator=g),
        "per_head": torch.rand(2, heads, 3, 7, generator=g) > 0.3,
    }[mask]
    if a is not None and a.dtype == torch.bool:
        a[..., 0] = True  # every row attends somewhere (an all-masked row is NaN in both)
    gqa = heads != kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=a, enable_gqa=gqa)
    devices = tuple(range(n))
    args = [place(t, "S1", devices) for t in (q, k, v)] if n > 1 else [q, k, v]
    with ops.attention_as_matmuls():
        got = ops.scaled_dot_product_attention(*args, a, enable_gqa=gqa)
    torch.testing.assert_close(_value(got), want, rtol=1e-5, atol=1e-5)


def test_attention_as_matmuls_needs_enable_gqa_for_fewer_kv_heads():
    # As torch: fewer KV heads without enable_gqa is an error, not a silent GQA.
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8)
    with ops.attention_as_matmuls(), pytest.raises(RuntimeError):
        ops.scaled_dot_product_attention(q, k, k)



@pytest.mark.parametrize("heads, shards, dim", [(1, 1, 1), (2, 2, 1), (2, 1, 1), (1, 2, 2)])
def test_unflatten_puts_the_split_on_the_heads_it_names(heads, shards, dim):
    # A projection [N, heads*hd] split on its features, unflattened to [N, heads, hd]: the
    # split goes to the heads (even one head in one shard, where reshape cannot tell the
    # heads from a size-1 dim), or to hd when a shard holds part of a head.
    x = torch.randn(5, heads * 8)
    y = ops.unflatten(ops.reshard_split(x, dim=1, count=shards), 1, [heads, 8])
    assert y.shard_dim == dim and torch.equal(ops.unshard(y), x.reshape(5, heads, 8))


@pytest.mark.parametrize("heads", [1, 2])
def test_flatten_and_unflatten_of_other_dims_only_shift_the_split(heads):
    # A cache [B, T, kv, hd] split on kv: merging B and T and splitting them again keeps kv split.
    x = torch.randn(2, 5, heads, 8)
    flat = ops.flatten(ops.reshard_split(x, dim=2, count=heads), 0, 1)
    back = ops.unflatten(flat, 0, [2, 5])
    assert (flat.shard_dim, back.shard_dim) == (1, 2) and torch.equal(ops.unshard(back), x)


def test_unflatten_refuses_a_split_it_cannot_keep():
    with pytest.raises(ops.ShardingError, match=r"ops.unflatten: dim 1 of \[5, 12\] split in sizes \[6, 6\] cannot become \[3, 4\]"):
        ops.unflatten(ops.reshard_split(torch.randn(5, 12), dim=1, count=2), 1, [3, 4])
