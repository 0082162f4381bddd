"""Sharded tensor types: construction, validation, metadata, pytree, equality."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from sharktank.types import (
    Partial,
    Replicate,
    ReplicatedTensor,
    ShardingSpec,
    Split,
    SplitPrimitiveTensor,
    UnreducedTensor,
    is_deep_equal,
)


def test_split_from_one_tensor_and_from_shards():
    t = torch.arange(24.0).reshape(4, 6)
    x = SplitPrimitiveTensor(shard_dim=1, ts=t, shard_count=3, name="w")
    assert x.shape == (4, 6) and x.shard_count == 3 and x.devices == (0, 1, 2) and not x.pinned
    assert x.dtype == torch.float32 and x.name == "w" and x.placement == Split(1) and str(x.placement) == "S(1)"
    y = SplitPrimitiveTensor(shard_dim=1, ts=list(x.shards), devices=(5, 2, 7), pinned=True)
    assert y.shape == (4, 6) and y.devices == (5, 2, 7) and y.pinned
    assert isinstance(y.shards, tuple)


def test_uneven_split_is_tensor_split_everywhere():
    x = SplitPrimitiveTensor(shard_dim=0, ts=torch.arange(5.0), shard_count=3)
    assert x.shard_sizes == [2, 2, 1]
    z = SplitPrimitiveTensor(shard_dim=0, ts=torch.arange(2.0), shard_count=4)
    assert z.shard_sizes == [1, 1, 0, 0] and z.shape == (2,)


def test_construction_errors_name_what_was_expected():
    with pytest.raises(ValueError, match=r"shard 0 has shape \[2, 3\], shard 1 has shape \[3, 3\]"):
        SplitPrimitiveTensor(shard_dim=1, ts=[torch.ones(2, 3), torch.ones(3, 3)])
    with pytest.raises(ValueError, match=r"expected 2 devices .* found 3"):
        ReplicatedTensor(ts=torch.ones(2), shard_count=2, devices=(0, 1, 2))
    with pytest.raises(ValueError, match="distinct"):
        ReplicatedTensor(ts=torch.ones(2), devices=(1, 1))
    with pytest.raises(ValueError, match="one shape"):
        UnreducedTensor(ts=[torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="shard_dim=2 is out of range"):
        SplitPrimitiveTensor(shard_dim=2, ts=torch.ones(2, 2), shard_count=2)
    with pytest.raises(ValueError, match="one dtype"):
        UnreducedTensor(ts=[torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="needs shard_count or devices"):
        ReplicatedTensor(ts=torch.ones(2))


def test_replicated_and_unreduced():
    r = ReplicatedTensor(ts=torch.ones(2, 2), shard_count=3, devices=(3, 4, 5))
    assert r.shape == (2, 2) and r.placement == Replicate() and r.devices == (3, 4, 5)
    u = UnreducedTensor(ts=[torch.ones(2), torch.ones(2)])
    assert u.placement == Partial() and str(u.placement) == "P(sum)"
    assert u.spec == ShardingSpec(Partial(), (0, 1))


def test_clone_changes_metadata_only():
    x = SplitPrimitiveTensor(shard_dim=0, ts=torch.ones(4), shard_count=2)
    y = x.clone(devices=(6, 7), pinned=True, name="moved")
    assert (y.devices, y.pinned, y.name, y.shard_dim) == ((6, 7), True, "moved", 0)
    assert all(a is b for a, b in zip(x.shards, y.shards))
    with pytest.raises(TypeError, match="unknown fields"):
        x.clone(device=3)
    assert "never moves data" in type(x).clone.__doc__


@pytest.mark.parametrize(
    "t",
    [
        SplitPrimitiveTensor(shard_dim=1, ts=torch.randn(2, 5), devices=(4, 1, 3), pinned=True, name="a"),
        ReplicatedTensor(ts=torch.randn(3), devices=(2, 0)),
        UnreducedTensor(ts=[torch.randn(2), torch.randn(2)], devices=(1, 0), pinned=True),
    ],
)
def test_pytree_flattens_to_shards_and_keeps_placement(t):
    leaves, spec = pytree.tree_flatten({"x": t})
    assert len(leaves) == t.shard_count and all(a is b for a, b in zip(leaves, t.shards))
    back = pytree.tree_unflatten(leaves, spec)["x"]
    assert is_deep_equal(back, t) and back.name == t.name


def test_is_deep_equal_compares_placement_unless_told_not_to():
    t = torch.randn(4, 2)
    a = SplitPrimitiveTensor(shard_dim=0, ts=t, shard_count=2)
    assert is_deep_equal(a, a.clone())
    assert not is_deep_equal(a, a.clone(devices=(1, 0)))
    assert is_deep_equal(a, a.clone(devices=(1, 0), pinned=True), compare_placement=False)
    assert not is_deep_equal(a, SplitPrimitiveTensor(shard_dim=1, ts=t, shard_count=2), compare_placement=False)
    assert not is_deep_equal(a, ReplicatedTensor(ts=t, shard_count=2))
    b = a.clone(ts=[a.shards[0], a.shards[1] + 1])
    assert not is_deep_equal(a, b)
    assert is_deep_equal([a, {"k": t}], [a.clone(), {"k": t.clone()}])


def test_is_deep_equal_method_is_the_function():
    t = torch.randn(4, 2)
    a = SplitPrimitiveTensor(shard_dim=0, ts=t, shard_count=2)
    moved = a.clone(devices=(1, 0))
    assert a.is_deep_equal(a.clone())
    assert not a.is_deep_equal(a.clone(ts=[a.shards[0], a.shards[1] + 1]))
    assert not a.is_deep_equal(t)
    assert not a.is_deep_equal(moved)
    assert a.is_deep_equal(moved, compare_placement=False)
    for other in (a.clone(), moved, ReplicatedTensor(ts=t, shard_count=2)):
        for cp in (True, False):
            assert a.is_deep_equal(other, compare_placement=cp) == is_deep_equal(a, other, compare_placement=cp)


def test_sharding_spec_is_small_immutable_data():
    s = ShardingSpec.split(1, devices=[2, 3], pinned=True)
    assert s.devices == (2, 3) and s.shard_count == 2 and str(s) == "S(1) on [2, 3], pinned"
    assert hash(s) == hash(ShardingSpec.split(1, devices=(2, 3), pinned=True))
    with pytest.raises(AttributeError):
        s.pinned = False  # type: ignore[misc]
