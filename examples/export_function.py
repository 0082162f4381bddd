"""Export your own function of sharded tensors, compile it for 2 CPU devices and run it with
the IREE runtime (no model, no manifest): the lowest layer `sharktank export` is built on.

The function is a tensor-parallel linear layer: ``x`` replicated, the weight split on its
output dim (column-parallel), so each device computes its slice of ``y``; then an all-gather
puts the whole ``y`` on both devices. The exported program's arguments sit on the devices the
shards name, and its transfers are the all-gather's (counted in the MLIR).

    python examples/export_function.py

Prints the transfers and the largest error against plain torch; exits 1 above 1e-5.
"""

from __future__ import annotations

import sys

import torch

from sharktank import ops
from sharktank.export import arg_devices, compile_mlir, count_transfers, export_function
from sharktank.runtime import Session
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor

DEVICES = 2


def forward(x: ReplicatedTensor, w: SplitPrimitiveTensor) -> ReplicatedTensor:
    """``x @ w.T`` with ``w`` split on its rows: a split result, gathered whole on every device."""
    return ops.all_gather(ops.linear(x, w))


def main() -> int:
    torch.manual_seed(0)
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    args = (ReplicatedTensor(ts=x, shard_count=DEVICES), SplitPrimitiveTensor(shard_dim=0, ts=w, shard_count=DEVICES, pinned=True))
    mlir = str(export_function(forward, args).mlir_module)
    print(f"exported: {count_transfers(mlir)} transfers (the all-gather: each device sends its slice to the other)")
    session = Session(compile_mlir(mlir, device_count=DEVICES), DEVICES)
    inputs = [s.numpy() for a in args for s in a.shards]
    results = session.call("main", inputs, arg_devices(args))  # one result per shard of y
    want = x @ w.T
    err = max(float((torch.from_numpy(r) - want).abs().max()) for r in results)
    print(f"{len(results)} results (y on each device); max |compiled - torch| = {err:.3g}")
    return 0 if err <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
