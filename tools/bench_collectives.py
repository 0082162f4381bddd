"""Harness rows for data moved: collectives against the bandwidth-optimal bytes per device,
and coalesced transfers against one transfer per tensor (see ``tools/bench.py``).

Each case runs eagerly under ``ops.record_transfers()`` and is exported with
``export_function``; the MLIR's ``flow.tensor.transfer`` ops are read by
:func:`bench_mlir.mlir_transfers`. Figures are counts and bytes, so they are exact.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

import torch

from sharktank import ops
from sharktank.ops import TransferLog
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor

from bench_mlir import mlir_transfers
from bench_timing import interleaved

__all__ = ["collective_rows", "coalesce_rows", "OPTIMAL"]

# Bytes each device sends and receives, as a fraction of the tensor, for N devices.
OPTIMAL: dict[str, Callable[[int], float]] = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
}
# Transfers of the direct (no-relay) schedules.
TRANSFERS: dict[str, Callable[[int], int]] = {
    "all_gather": lambda n: n * (n - 1),
    "reduce_scatter": lambda n: n * (n - 1),
    "all_reduce": lambda n: n * (n - 1) if n == 2 else 2 * n * (n - 1),  # two devices swap shards
}


def _mlir_log(fn: Callable, args: tuple) -> TransferLog:
    from sharktank.export import export_function

    return mlir_transfers(str(export_function(fn, args).mlir_module))["main"]


def _per_device(log: TransferLog, devices: range, size: int) -> dict:
    sent = [log.bytes_sent(d) / size for d in devices]
    received = [log.bytes_received(d) / size for d in devices]
    return {
        "transfers": len(log),
        "sent_min": min(sent),
        "sent_max": max(sent),
        "received_min": min(received),
        "received_max": max(received),
        "unknown_source": sum(1 for t in log if t.src is None),
    }


def _collective_case(op: str, n: int, t: torch.Tensor) -> tuple[Callable, object]:
    if op == "all_gather":
        return ops.all_gather, SplitPrimitiveTensor(shard_dim=0, ts=t, shard_count=n)
    parts = [torch.randn(t.shape) for _ in range(n)]
    u = UnreducedTensor(ts=parts)
    return (ops.all_reduce if op == "all_reduce" else (lambda x: ops.reduce_scatter(x, 0))), u


def collective_rows(counts=(2, 4, 8), export: bool = True, shape=(64, 32)) -> list[dict]:
    """Transfers and bytes per device (fractions of the tensor) for each collective and N."""
    rows = []
    t = torch.randn(shape)
    size = t.numel() * t.element_size()
    for n in counts:
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            fn, x = _collective_case(op, n, t)
            with ops.record_transfers() as log:
                fn(x)
            row = {"op": op, "n": n, "tensor_bytes": size, "optimal": OPTIMAL[op](n), "optimal_transfers": TRANSFERS[op](n)}
            row["eager"] = _per_device(log, range(n), size)
            if export:
                row["mlir"] = _per_device(_mlir_log(fn, (x,)), range(n), size)
            row["met"] = all(
                math.isclose(m[k], row["optimal"]) and m["transfers"] == row["optimal_transfers"]
                for m in (row["eager"], row.get("mlir", row["eager"]))
                for k in ("sent_min", "sent_max", "received_min", "received_max")
            )
            rows.append(row)
    return rows


def _buckets(log: TransferLog) -> int:
    """Transfers per (src, dst) pair, the most any pair has."""
    pairs: dict = {}
    for t in log:
        pairs[(t.src, t.dst)] = pairs.get((t.src, t.dst), 0) + 1
    return max(pairs.values(), default=0)


def coalesce_rows(n: int = 4, export: bool = True, rounds: int = 5, small=(8 << 10, 16 << 10)) -> list[dict]:
    """Transfer counts of many small tensors crossing devices, one transfer per tensor vs
    coalesced (default buckets, and ``small`` = (first, cap) bytes to show several buckets)."""
    first, cap = small
    reduce_list = [UnreducedTensor(ts=[torch.randn(1, 8, 64) for _ in range(n)]) for _ in range(16)]
    # A pipeline stage boundary: the hidden state and two blocks' K/V cache slices, devices 0,1 -> 2,3.
    # Distinct shard objects: torch.export merges arguments that are the same tensor.
    hidden = torch.randn(1, 8, 64)
    boundary = [ReplicatedTensor(ts=[hidden, hidden.clone()])] + [
        SplitPrimitiveTensor(shard_dim=2, ts=torch.randn(1, 128, 4, 16), shard_count=2) for _ in range(4)
    ]
    cases = {
        f"all_reduce x{len(reduce_list)} N={n}": (
            reduce_list,
            lambda ts: [ops.all_reduce(t) for t in ts],
            lambda ts, **kw: ops.all_reduce_coalesced(ts, **kw),
            # per tensor; per bucket (reduce_scatter + all_gather, even at N=2)
            (TRANSFERS["all_reduce"](n), 2 * n * (n - 1)),
        ),
        f"stage boundary x{len(boundary)} [0,1]->[2,3]": (
            boundary,
            lambda ts: [ops.transfer_to_logical_device(t, (2, 3)) for t in ts],
            lambda ts, **kw: ops.transfer_coalesced(ts, (2, 3), **kw),
            (2, 2),
        ),
    }
    rows = []
    for name, (tensors, plain, coalesced, (per_tensor, per_bucket)) in cases.items():
        nbytes = sum(t.shards[0].numel() * t.dtype.itemsize for t in tensors)
        variants = {
            "per_tensor": (plain, {}),
            "coalesced": (coalesced, {}),
            "coalesced_small": (coalesced, {"bucket_bytes": cap, "first_bucket_bytes": first}),
        }
        row = {"case": name, "tensors": len(tensors), "shard_bytes": nbytes, "small_buckets": [first, cap]}
        reference = plain(tensors)
        for key, (fn, kw) in variants.items():
            with ops.record_transfers() as log:
                out = fn(tensors, **kw)
            assert all(ops.equal(a, b) and a.devices == b.devices for a, b in zip(out, reference)), name
            # Every pair (or every device, reducing) carries one shard of each tensor: nbytes.
            buckets = len(tensors) if key == "per_tensor" else len(ops.bucket_sizes(nbytes // 4, 4, **kw))
            devices = sorted({d for t in log for d in (t.src, t.dst)})
            v = {"expected": (per_tensor if key == "per_tensor" else per_bucket) * buckets, "eager": len(log), "per_pair_eager": _buckets(log)}
            v["eager_max_sent"] = max(log.bytes_sent(d) for d in devices)
            if export:
                mlog = _mlir_log(lambda *ts: fn(list(ts), **kw), tuple(tensors))
                v["mlir"] = len(mlog)
                v["mlir_max_sent"] = max(mlog.bytes_sent(d) for d in devices)
            row[key] = v
        # Eager cost of each variant, timed interleaved (informational: no target).
        times = interleaved({key: (lambda fn=fn, kw=kw: fn(tensors, **kw)) for key, (fn, kw) in variants.items()}, rounds, inner=20)
        for key, t in times.items():
            row[key]["eager_us"] = statistics.median(t) * 1e6
        rows.append(row)
    return rows
