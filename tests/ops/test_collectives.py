"""Collectives: values against torch and the transfers and bytes each device moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from placing import device_tuples, place
from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor

shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3)


@given(shape=shapes, devices=device_tuples(1, 8), data=st.data())
def test_all_gather_counts_and_values(shape, devices, data):
    n = len(devices)
    dim = data.draw(st.integers(0, len(shape) - 1))
    t = torch.randn(shape)
    x = SplitPrimitiveTensor(shard_dim=dim, ts=t, devices=devices)
    with ops.record_transfers() as log:
        y = ops.all_gather(x)
    assert isinstance(y, ReplicatedTensor) and y.devices == devices
    for s in y.shards:
        assert torch.equal(s, t)
    # Every non-empty shard goes straight to every other device.
    assert len(log) == sum((n - 1) for s in x.shards if s.numel())
    for i, d in enumerate(devices):
        own = x.shards[i].numel() * 4
        assert log.bytes_sent(d) == own * (n - 1)
        assert log.bytes_received(d) == t.numel() * 4 - own
        assert all(tr.src != tr.dst for tr in log)


@given(shape=shapes, devices=device_tuples(1, 8))
def test_all_reduce_is_bandwidth_optimal(shape, devices):
    n = len(devices)
    t = torch.randn(shape)
    u = place(t, "P", devices)
    with ops.record_transfers() as log:
        y = ops.all_reduce(u)
    assert isinstance(y, ReplicatedTensor) and y.devices == devices
    for s in y.shards:
        torch.testing.assert_close(s, t, atol=1e-4, rtol=1e-4)
        assert torch.equal(s, y.shards[0])  # every device computed the same bits
    numel = t.numel()
    if n == 2:  # a swap of whole shards: one tensor each way, the optimal 2(N-1)/N = 1
        assert len(log) == (2 if numel else 0)
        assert all(log.bytes_sent(d) == log.bytes_received(d) == numel * 4 for d in devices)
        return
    pieces = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    assert len(log) == 2 * (n - 1) * sum(1 for p in pieces if p)
    for i, d in enumerate(devices):
        # reduce-scatter: send every piece but mine; all-gather: send mine to n-1 devices.
        sent = (numel - pieces[i]) + pieces[i] * (n - 1)
        assert log.bytes_sent(d) == sent * 4
        assert log.bytes_received(d) == sent * 4
        if numel % n == 0:
            assert log.bytes_sent(d) == 2 * (n - 1) * numel * 4 // n


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_no_device_carries_n_minus_1_tensors(n):
    t = torch.randn(64, 8)
    with ops.record_transfers() as log:
        ops.all_reduce(place(t, "P", tuple(range(n))))
    size = t.numel() * 4
    for d in range(n):
        assert log.bytes_received(d) == 2 * (n - 1) * size // n
        assert log.bytes_sent(d) == 2 * (n - 1) * size // n


@given(shape=shapes, devices=device_tuples(1, 8), data=st.data())
def test_reduce_scatter_counts_and_values(shape, devices, data):
    n = len(devices)
    dim = data.draw(st.integers(0, len(shape) - 1))
    t = torch.randn(shape)
    with ops.record_transfers() as log:
        y = ops.reduce_scatter(place(t, "P", devices), dim)
    assert isinstance(y, SplitPrimitiveTensor) and y.shard_dim == dim and y.devices == devices
    torch.testing.assert_close(ops.unshard(y), t, atol=1e-4, rtol=1e-4)
    sizes = [p.numel() for p in torch.tensor_split(t, n, dim)]
    assert len(log) == (n - 1) * sum(1 for s in sizes if s)
    for i, d in enumerate(devices):
        assert log.bytes_received(d) == sizes[i] * (n - 1) * 4
        assert log.bytes_sent(d) == (t.numel() - sizes[i]) * 4


def test_uneven_split_sizes_follow_tensor_split():
    t = torch.arange(10.0)
    x = SplitPrimitiveTensor(shard_dim=0, ts=t, shard_count=4)
    assert x.shard_sizes == [3, 3, 2, 2]
    assert [s.numel() for s in torch.tensor_split(t, 4)] == x.shard_sizes
    assert torch.equal(ops.all_gather(x).shards[2], t)
    y = ops.reduce_scatter(UnreducedTensor(ts=[t, t, t, t]), 0)
    assert y.shard_sizes == [3, 3, 2, 2] and torch.equal(ops.unshard(y), 4 * t)


def test_unshard_cat_and_sum_move_to_root():
    x = SplitPrimitiveTensor(shard_dim=1, ts=torch.randn(2, 6), devices=(3, 1, 2))
    with ops.record_transfers() as log:
        ops.sharded_cat(x, root=1)
    assert [(t.src, t.dst) for t in log] == [(3, 1), (2, 1)]
    u = place(torch.randn(3), "P", (0, 1, 2))
    with ops.record_transfers() as log:
        ops.sharded_sum(u)
    assert len(log) == 2


def test_replicate_and_reshard_split_of_plain_tensors_place_pieces():
    t = torch.randn(5, 2)
    with ops.record_transfers() as log:
        r = ops.replicate(t, devices=(4, 6), pinned=True)
    assert r.devices == (4, 6) and r.pinned and [(x.src, x.dst) for x in log] == [(None, 4), (None, 6)]
    with ops.record_transfers() as log:
        s = ops.reshard_split(t, dim=0, count=2)
    assert s.shard_sizes == [3, 2] and len(log) == 2 and log.total_bytes() == t.numel() * 4
    with ops.record_transfers() as log:
        s2 = ops.reshard_split(r, dim=1)  # replicated: each device keeps its piece
    assert len(log) == 0 and s2.devices == (4, 6) and torch.equal(ops.unshard(s2), t)


def test_reshard_and_reshard_like():
    from sharktank.types import ShardingSpec

    t = torch.randn(4, 6)
    x = SplitPrimitiveTensor(shard_dim=0, ts=t, devices=(0, 1))
    y = ops.reshard(x, ShardingSpec.split(1, devices=(2, 3), pinned=True))
    assert y.shard_dim == 1 and y.devices == (2, 3) and y.pinned and torch.equal(ops.unshard(y), t)
    z = ops.reshard_like(t, y)
    assert z.spec == y.spec and torch.equal(ops.unshard(z), t)
    r = ops.reshard(x, ShardingSpec.replicate(devices=(0, 1)))
    assert isinstance(r, ReplicatedTensor) and torch.equal(r.shards[1], t)


def test_transfer_and_barrier():
    t = torch.randn(3)
    with ops.record_transfers() as log:
        u = ops.transfer_to_logical_device(t, 2)
    assert torch.equal(u, t) and u is not t and len(log) == 1 and log[0].dst == 2
    assert ops.barrier_on_logical_device(t, 1) is t
    with pytest.raises(TypeError, match="one device per shard"):
        ops.transfer_to_logical_device(ReplicatedTensor(ts=t, shard_count=2), 1)
    with pytest.raises(ValueError, match="distinct"):
        ops.transfer_to_logical_device(ReplicatedTensor(ts=t, shard_count=2), [1, 1])


def test_nested_record_transfers_both_see():
    x = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(4), shard_count=2)
    with ops.record_transfers() as outer:
        with ops.record_transfers() as inner:
            ops.all_gather(x)
        ops.all_gather(x)
    assert len(inner) == 2 and len(outer) == 4
