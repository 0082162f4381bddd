"""Transfers in exported programs: coalesced ops give one flow.tensor.transfer per bucket per
pair and run correctly when compiled; collectives move the bandwidth-optimal bytes in the
MLIR too (read by tools/bench_mlir.py, which is checked here as well)."""

from __future__ import annotations

import pytest
import torch

from bench_mlir import mlir_transfers
from placing import all_reduce_transfers
from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor

KIB = 1024


def _export(fn, args) -> str:
    from sharktank.export import export_function

    return str(export_function(fn, args).mlir_module)


def _run(mlir: str, args: tuple, device_count: int) -> list:
    from sharktank.export import arg_devices, compile_mlir
    from sharktank.runtime import Session

    session = Session(compile_mlir(mlir, device_count=device_count), device_count)
    return session.call("main", [s.numpy() for a in args for s in a.shards], arg_devices(args))


def test_all_reduce_coalesced_exports_one_transfer_per_bucket_and_runs():
    n = 2
    # 6 tensors of 1 KiB; buckets of 2 KiB (first 2 KiB): 3 buckets instead of 6 tensors.
    ts = tuple(UnreducedTensor(ts=[torch.randn(16, 16) for _ in range(n)]) for _ in range(6))
    coalesced = _export(lambda *xs: ops.all_reduce_coalesced(list(xs), bucket_bytes=2 * KIB, first_bucket_bytes=2 * KIB), ts)
    plain = _export(lambda *xs: [ops.all_reduce(x) for x in xs], ts)
    from sharktank.export import count_transfers

    assert count_transfers(plain) == all_reduce_transfers(n) * 6
    # Buckets are all-reduced as reduce_scatter + all_gather even on two devices (a swap of
    # sliced buckets does not compile in IREE 3.10).
    assert count_transfers(coalesced) == 2 * n * (n - 1) * 3
    log = mlir_transfers(coalesced)["main"]
    assert all(t.src is not None and t.src != t.dst for t in log)
    assert {t.nbytes for t in log} == {KIB}  # half a 2 KiB bucket per piece
    # Before the barriers in all_reduce_coalesced, IREE 3.10 compiled this very program to
    # zeros for the first tensor: the run below is the regression test.
    for d in range(n):
        assert log.bytes_sent(d) == log.bytes_received(d) == 2 * (n - 1) * 6 * KIB // n
    out = _run(coalesced, ts, n)
    want = [ops.unshard(t) for t in ts for _ in range(n)]
    for got, w in zip(out, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(got), w, atol=1e-5, rtol=1e-5)


def test_all_reduce_coalesced_of_computed_partial_sums_runs_on_four_devices():
    # Partial sums computed in the program, 5 tensors over a 128-byte first bucket and
    # 256-byte buckets, so tensors straddle buckets.
    n = 4
    ts = tuple(UnreducedTensor(ts=[torch.randn(48) for _ in range(n)]) for _ in range(5))

    def fn(*xs):
        return ops.all_reduce_coalesced([ops.mul(x, 2.0) for x in xs], bucket_bytes=256, first_bucket_bytes=128)

    fn(*ts)  # fills the dispatch cache outside tracing
    mlir = _export(fn, ts)
    from sharktank.export import count_transfers

    assert count_transfers(mlir) == 2 * n * (n - 1) * len(ops.bucket_sizes(5 * 48, 4, 256, 128))
    out = _run(mlir, ts, n)
    for got, want in zip(out, [2 * ops.unshard(t) for t in ts for _ in range(n)], strict=True):
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5)


def test_transfer_coalesced_stage_boundary_exports_one_transfer_per_pair_and_runs():
    hidden = torch.randn(1, 8, 64)
    ts = (ReplicatedTensor(ts=[hidden, hidden.clone()]),) + tuple(
        SplitPrimitiveTensor(shard_dim=2, ts=torch.randn(1, 16, 4, 8), shard_count=2) for _ in range(4)
    )
    mlir = _export(lambda *xs: ops.transfer_coalesced(list(xs), [2, 3]), ts)
    log = mlir_transfers(mlir)["main"]
    assert [(t.src, t.dst) for t in log] == [(0, 2), (1, 3)]
    assert log.bytes_sent(0) == sum(t.shards[0].numel() * 4 for t in ts)
    per_tensor = mlir_transfers(_export(lambda *xs: [ops.transfer_to_logical_device(x, [2, 3]) for x in xs], ts))["main"]
    assert len(per_tensor) == 2 * len(ts)
    assert "__device_2" in mlir and "__device_3" in mlir
    out = _run(mlir, ts, 4)
    for got, want in zip(out, [s for t in ts for s in t.shards], strict=True):
        assert torch.equal(torch.from_numpy(got), want)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_collectives_in_mlir_move_the_optimal_bytes(n):
    t = torch.randn(8 * n, 4)
    size = t.numel() * 4
    cases = {
        "all_gather": (ops.all_gather, SplitPrimitiveTensor(shard_dim=0, ts=t, shard_count=n), (n - 1) * size // n),
        "all_reduce": (ops.all_reduce, UnreducedTensor(ts=[torch.randn(t.shape) for _ in range(n)]), 2 * (n - 1) * size // n),
    }
    for name, (fn, x, optimal) in cases.items():
        log = mlir_transfers(_export(fn, (x,)))["main"]
        for d in range(n):
            assert log.bytes_sent(d) == log.bytes_received(d) == optimal, (name, d)
        assert all(tr.src is not None for tr in log)


MLIR = """
module @module {
  util.global private @"w@d1" {stream.affinity = #hal.device.promise<@__device_1>} = #flow.parameter.named<"model"::"w@d1"> : tensor<4x8xf16>
  func.func @f(%arg0: !torch.vtensor<[2,3],f32> {iree.abi.affinity = #hal.device.promise<@__device_0>}, %arg1: !torch.vtensor<[?,3],f32> {iree.abi.affinity = #hal.device.promise<@__device_2>}) -> !torch.vtensor<[2,3],f32> {
    %int1 = torch.constant.int 1
    %0:2 = torch.prim.ListUnpack %arg0 : !torch.vtensor<[2,3],f32> -> !torch.vtensor<[1,3],f32>, !torch.vtensor<[1,3],f32>
    %1 = torch_c.to_builtin_tensor %0#1 : !torch.vtensor<[1,3],f32> -> tensor<1x3xf32>
    %2 = flow.tensor.transfer %1 : tensor<1x3xf32> to #hal.device.promise<@__device_1>
    %3 = flow.tensor.transfer %2 : tensor<1x3xf32> to #hal.device.promise<@__device_3>
    %w = util.global.load @"w@d1" : tensor<4x8xf16>
    %4 = flow.tensor.transfer %w : tensor<4x8xf16> to #hal.device.promise<@__device_0>
    %5 = torch_c.to_builtin_tensor %arg1 : !torch.vtensor<[?,3],f32> -> tensor<?x3xf32>
    %6 = flow.tensor.transfer %5 : tensor<?x3xf32>{%int1} to #hal.device.promise<@__device_0>
    return %arg0 : !torch.vtensor<[2,3],f32>
  }
  func.func @g(%arg0: !torch.vtensor<[2],si64>) -> !torch.vtensor<[2],si64> {
    return %arg0 : !torch.vtensor<[2],si64>
  }
}
"""


def test_mlir_transfers_follows_values_to_their_devices():
    logs = mlir_transfers(MLIR)
    assert set(logs) == {"f", "g"} and len(logs["g"]) == 0
    log = logs["f"]
    assert [(t.src, t.dst) for t in log] == [(0, 1), (1, 3), (1, 0), (2, 0)]
    assert [t.nbytes for t in log[:3]] == [12, 12, 64]
    assert log[3].shape == (None, 3)
    with pytest.raises(ValueError, match="dynamic size"):
        log[3].nbytes
    assert log.bytes_sent(1) == 12 + 64 and log.bytes_received(3) == 12
