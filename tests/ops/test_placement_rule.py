"""The placement rule (transfer-if-needed), case by case, with transfers counted."""

from __future__ import annotations

import pytest
import torch

from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor


def rep(devices, pinned=False, shape=(2, 4)):
    return ReplicatedTensor(ts=torch.randn(shape), devices=devices, pinned=pinned)


def test_same_devices_nothing_moves():
    a, b = rep((0, 1)), rep((0, 1))
    with ops.record_transfers() as log:
        c = ops.add(a, b)
    assert len(log) == 0
    assert c.devices == (0, 1) and not c.pinned


def test_unpinned_moves_to_pinned_shard_by_shard():
    w = rep((4, 5), pinned=True)
    x = rep((0, 1))
    with ops.record_transfers() as log:
        y = ops.add(x, w)
    assert [(t.src, t.dst) for t in log] == [(0, 4), (1, 5)]
    assert all(t.shape == (2, 4) and t.dtype == torch.float32 for t in log)
    assert y.devices == (4, 5)
    assert not y.pinned  # weight + activation gives an activation that may flow on
    torch.testing.assert_close(ops.unshard(y), ops.unshard(x) + ops.unshard(w))


def test_shards_already_in_place_are_not_moved():
    w = rep((0, 5), pinned=True)
    with ops.record_transfers() as log:
        ops.add(rep((0, 1)), w)
    assert [(t.src, t.dst) for t in log] == [(1, 5)]


def test_several_unpinned_operands_move_and_results_are_unpinned():
    w = rep((2, 3), pinned=True)
    with ops.record_transfers() as log:
        out = ops.cat([rep((0, 1)), w, rep((6, 7))], dim=0)
    assert len(log) == 4
    assert out.devices == (2, 3) and not out.pinned


def test_operands_inside_lists_tuples_dicts_and_kwargs_are_collected():
    w = rep((2, 3), pinned=True)
    moved = ops.transfer_if_needed({"a": [rep((0, 1))], "b": (w,)})
    assert moved[0]["a"][0].devices == (2, 3)
    with ops.record_transfers() as log:
        out = ops.linear(rep((0, 1)), weight=SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(6, 4), devices=(2, 3), pinned=True))
    assert len(log) == 2 and out.devices == (2, 3)


def test_pinned_on_different_devices_is_an_error_naming_everything():
    with pytest.raises(ops.PlacementError) as e:
        ops.add(rep((0, 1), pinned=True), rep((2, 3), pinned=True))
    msg = str(e.value)
    assert "ops.add" in msg and "devices=[0, 1] pinned=True" in msg and "devices=[2, 3] pinned=True" in msg
    assert isinstance(e.value, ValueError)


def test_different_devices_none_pinned_is_an_error():
    with pytest.raises(ops.PlacementError, match=r"ops\.matmul.*none is pinned.*devices=\[0, 1\] pinned=False.*devices=\[2, 3\] pinned=False"):
        ops.matmul(rep((0, 1)), rep((2, 3), shape=(4, 2)))


def test_shard_count_mismatch_with_pinned_is_an_error():
    with pytest.raises(ops.PlacementError, match="cannot move 3 shards"):
        ops.add(rep((0, 1, 2)), rep((4, 5), pinned=True))


def test_result_pinned_exactly_when_every_operand_pinned():
    a, b = rep((0, 1), pinned=True), rep((0, 1), pinned=True)
    assert ops.add(a, b).pinned
    assert ops.softmax(a, 1).pinned  # unary op on a pinned tensor
    assert not ops.add(a, rep((0, 1))).pinned
    assert ops.transpose(a, 0, 1).pinned
    assert ops.all_gather(SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(4, 2), devices=(0, 1), pinned=True)).pinned


def test_plain_tensor_is_treated_as_replicated_without_transfers():
    x = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(4, 3), devices=(6, 7))
    bias = torch.randn(4, 3)
    with ops.record_transfers() as log:
        y = ops.add(x, bias)
    assert len(log) == 0
    assert y.devices == (6, 7)
    torch.testing.assert_close(ops.unshard(y), ops.unshard(x) + bias)


def test_data_placing_ops_skip_the_rule():
    assert ops.transfer_to_logical_device.places_data and ops.all_gather.places_data
    assert not ops.add.places_data
    x = rep((0, 1), pinned=True)
    with ops.record_transfers() as log:
        y = ops.transfer_to_logical_device(x, [2, 3])
    assert y.devices == (2, 3) and y.pinned and len(log) == 2


def test_clone_relabels_without_moving():
    x = rep((0, 1))
    with ops.record_transfers() as log:
        y = x.clone(devices=(4, 5), pinned=True)
    assert len(log) == 0
    assert y.devices == (4, 5) and y.pinned and y.shards[0] is x.shards[0]


def test_unreduced_moves_too():
    u = UnreducedTensor(ts=[torch.randn(2), torch.randn(2)], devices=(0, 1))
    w = rep((3, 4), pinned=True, shape=(2,))
    with ops.record_transfers() as log:
        y = ops.mul(u, w)
    assert len(log) == 2 and isinstance(y, UnreducedTensor) and y.devices == (3, 4)
