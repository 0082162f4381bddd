"""Every op, every placement of its operands, against unsharded torch.

For each drawn combination the op must either equal the torch result (with the result on
the operands' devices) or raise the documented error (ShardingError,
NoImplementationError). The placements each op must support are also run one by one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from cases import CASES, Built
from placing import device_tuples, kinds_for, place
from sharktank import ops
from sharktank.types import ShardedTensor, UnreducedTensor

REFUSALS = (ops.ShardingError, ops.NoImplementationError)


def _value(x):
    return ops.unshard(x) if isinstance(x, ShardedTensor) else x


def _check(b: Built, kinds, devices, gen):
    placed = [place(t, k, devices, gen=gen) for t, k in zip(b.tensors, kinds)]
    expected = b.ref(*b.tensors)
    got = b.call(*placed)
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


def _kinds_ok(b: Built, kinds) -> bool:
    for i, k in enumerate(kinds):
        t = b.tensors[i]
        if k == "P" and (i in b.no_partial or not t.is_floating_point()):
            return False
        if k.startswith("S") and int(k[1:]) >= t.ndim:
            return False
    return any(k != "T" for k in kinds)


@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_op_matches_torch_or_refuses(name, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    b = CASES[name](data.draw, gen)
    devices = data.draw(device_tuples(1, 8))
    kinds = tuple(data.draw(st.sampled_from(kinds_for(t.ndim))) for t in b.tensors)
    if not _kinds_ok(b, kinds):
        return
    try:
        _check(b, kinds, devices, gen)
    except REFUSALS:
        assert kinds not in b.required, f"{name} must support {kinds}"


@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_required_placements_work(name, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    b = CASES[name](data.draw, gen)
    devices = data.draw(device_tuples(1, 8))
    required = [k for k in b.required if _kinds_ok(b, k)]
    assert required or all(t.ndim == 0 for t in b.tensors)
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
