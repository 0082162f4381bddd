"""Coalesced transfers: equal to the uncoalesced ops, one transfer per bucket per pair."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, strategies as st

from placing import device_tuples, place
from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor, is_deep_equal

KIB = 1024


def _pairs(log) -> dict:
    out: dict = {}
    for t in log:
        out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + 1
    return out


@pytest.mark.parametrize("name", ["all_reduce_coalesced", "transfer_coalesced"])
def test_public_ops_are_typed_documented_and_registered(name):
    op = getattr(ops, name)
    assert name in ops.__all__ and name in ops.registered_ops() and op.places_data
    assert op.__doc__ and "bucket" in op.__doc__
    sig = inspect.signature(op)
    assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values())
    assert sig.parameters["bucket_bytes"].default == ops.BUCKET_BYTES == 25 * 2**20
    assert sig.parameters["first_bucket_bytes"].default == ops.FIRST_BUCKET_BYTES == 2**20


@given(numel=st.integers(0, 5000), itemsize=st.sampled_from([1, 2, 4, 8]), first=st.integers(1, 3000), cap=st.integers(1, 3000))
def test_bucket_sizes_first_bucket_then_cap(numel, itemsize, first, cap):
    sizes = ops.bucket_sizes(numel, itemsize, bucket_bytes=cap, first_bucket_bytes=first)
    f, c = max(1, first // itemsize), max(1, cap // itemsize)
    assert sum(sizes) == numel and all(s > 0 for s in sizes)
    if numel:
        assert sizes[0] == min(numel, f)
        assert all(s == c for s in sizes[1:-1]) and all(s <= c for s in sizes[1:])
        assert len(sizes) == 1 + math.ceil(max(0, numel - f) / c)


def test_bucket_sizes_examples_and_errors():
    assert ops.bucket_sizes(10, 4, bucket_bytes=16, first_bucket_bytes=8) == [2, 4, 4]
    assert ops.bucket_sizes(3 * 2**18, 4) == [2**18, 2**19]  # 3 MiB of float32: 1 MiB, then 2 MiB (under 25)
    assert ops.bucket_sizes(0, 4) == []
    with pytest.raises(ValueError, match="bucket sizes must be positive"):
        ops.bucket_sizes(4, 4, bucket_bytes=0)


@given(
    devices=device_tuples(1, 5),
    shapes=st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=3), min_size=1, max_size=8),
    first=st.sampled_from([4, 16, 64, 1 << 20]),
    cap=st.sampled_from([4, 32, 256, 25 << 20]),
)
def test_all_reduce_coalesced_equals_all_reduce_bit_for_bit(devices, shapes, first, cap):
    n = len(devices)
    ts = [place(torch.randn(s), "P", devices, pinned=i % 2 == 0) for i, s in enumerate(shapes)]
    with ops.record_transfers() as plain_log:
        want = [ops.all_reduce(t) for t in ts]
    with ops.record_transfers() as log:
        got = ops.all_reduce_coalesced(ts, bucket_bytes=cap, first_bucket_bytes=first)
    assert len(got) == len(ts)
    for g, w in zip(got, want):
        assert is_deep_equal(g, w)  # type, devices, pinned, values: the same sums in the same order
    # Per bucket, all_reduce sends every non-empty piece to the n-1 other devices, twice.
    numel = sum(math.prod(s) for s in shapes)
    sizes = ops.bucket_sizes(numel, 4, bucket_bytes=cap, first_bucket_bytes=first)
    assert len(log) == (0 if n == 1 else sum(2 * (n - 1) * min(n, b) for b in sizes))
    # The same data moves, in fewer pieces (cut per bucket, not per tensor, so uneven splits
    # may put a few elements on other devices).
    assert log.total_bytes() == plain_log.total_bytes()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_coalesced_one_transfer_per_bucket_per_pair(n):
    # 12 tensors of 1 KiB, buckets of 4 KiB (first bucket 4 KiB too): ceil(12/4) = 3 buckets.
    ts = [UnreducedTensor(ts=[torch.randn(256) for _ in range(n)]) for _ in range(12)]
    with ops.record_transfers() as log:
        ops.all_reduce_coalesced(ts, bucket_bytes=4 * KIB, first_bucket_bytes=4 * KIB)
    pairs = _pairs(log)
    assert len(pairs) == n * (n - 1) and set(pairs.values()) == {2 * 3}  # reduce-scatter + all-gather per bucket
    assert len(log) == 2 * n * (n - 1) * 3
    total = 12 * KIB
    for d in range(n):
        assert log.bytes_sent(d) == log.bytes_received(d) == 2 * (n - 1) * total // n
    # Defaults: 12 KiB fit the first 1 MiB bucket.
    with ops.record_transfers() as log:
        ops.all_reduce_coalesced(ts)
    assert len(log) == 2 * n * (n - 1)


def test_all_reduce_coalesced_groups_by_devices_and_dtype_and_passes_replicated():
    a = UnreducedTensor(ts=[torch.randn(8), torch.randn(8)], devices=(0, 1))
    b = UnreducedTensor(ts=[torch.randn(8), torch.randn(8)], devices=(2, 3))
    c = UnreducedTensor(ts=[torch.randn(8).double(), torch.randn(8).double()], devices=(0, 1))
    r = ReplicatedTensor(ts=torch.randn(3), shard_count=2)
    with ops.record_transfers() as log:
        out = ops.all_reduce_coalesced([a, r, b, c, a])
    assert out[1] is r
    for x, y in zip(out, [a, r, b, c, a]):
        assert is_deep_equal(x, ops.all_reduce(y))
    # three groups: (0,1) float32 [a, a], (2,3) float32, (0,1) float64: one bucket each.
    assert len(log) == 3 * 2 * 2 * 1
    assert ops.all_reduce_coalesced([]) == []


def test_all_reduce_coalesced_refuses_split():
    s = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(4), shard_count=2)
    with pytest.raises(ops.ShardingError, match="not a partial sum"):
        ops.all_reduce_coalesced([s])


@given(
    count=st.integers(1, 4),
    shapes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=6),
    kinds=st.data(),
    cap=st.sampled_from([4, 40, 400, 25 << 20]),
)
def test_transfer_coalesced_equals_transfer_to_logical_device(count, shapes, kinds, cap):
    src = tuple(range(count))
    dst = tuple(range(count, 2 * count))[::-1]
    ts = []
    for s in shapes:
        kind = kinds.draw(st.sampled_from(["R", "P"] + [f"S{d}" for d in range(len(s))]))
        ts.append(place(torch.randn(s), kind, src, pinned=kinds.draw(st.booleans())))
    want = [ops.transfer_to_logical_device(t, dst) for t in ts]
    with ops.record_transfers() as log:
        got = ops.transfer_coalesced(ts, dst, bucket_bytes=cap, first_bucket_bytes=cap)
    for g, w in zip(got, want):
        assert is_deep_equal(g, w)
    # Per (src, dst) pair: ceil(bytes crossing that pair / cap) transfers.
    # Per (src, dst) pair: ceil(bytes crossing that pair / cap) transfers; empty shards none.
    pairs = _pairs(log)
    for i, (s, d) in enumerate(zip(src, dst)):
        nbytes = sum(t.shards[i].numel() * 4 for t in ts)
        assert pairs.get((s, d), 0) == len(ops.bucket_sizes(nbytes // 4, 4, cap, cap)) == math.ceil(nbytes / max(cap, 4))
        assert log.bytes_sent(s) == nbytes and log.bytes_received(d) == nbytes
    assert set(pairs) <= set(zip(src, dst))


def test_transfer_coalesced_stage_boundary_is_one_transfer_per_pair():
    hidden = ReplicatedTensor(ts=torch.randn(1, 8, 64), shard_count=2)
    cache = [SplitPrimitiveTensor(shard_dim=2, ts=torch.randn(1, 16, 4, 8), shard_count=2, pinned=True) for _ in range(4)]
    with ops.record_transfers() as log:
        out = ops.transfer_coalesced([hidden, *cache], [2, 3])
    assert [(t.src, t.dst) for t in log] == [(0, 2), (1, 3)]
    assert all(t.devices == (2, 3) for t in out) and [t.pinned for t in out] == [False] + [True] * 4
    for a, b in zip(out, [hidden, *cache]):
        assert ops.equal(a, b) and type(a) is type(b)


def test_transfer_coalesced_keeps_shards_in_place_and_checks_devices():
    t = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(6), shard_count=3)
    with ops.record_transfers() as log:
        out = ops.transfer_coalesced([t, t], [0, 5, 2])
    assert [(x.src, x.dst) for x in log] == [(1, 5)]
    assert out[0].shards[0] is t.shards[0] and out[0].devices == (0, 5, 2)
    with pytest.raises(ops.PlacementError, match="has 3 shards"):
        ops.transfer_coalesced([t], [0, 1])
    with pytest.raises(TypeError, match="one device per shard"):
        ops.transfer_coalesced([t], 1)
    with pytest.raises(ValueError, match="distinct"):
        ops.transfer_coalesced([t], [4, 4, 5])
