"""Shard a small feed-forward network and check it against unsharded torch.

1. Tensor parallel over 4 devices: the first linear is column-parallel (weight split on
   its output dim), the second row-parallel (weight split on its input dim), giving
   partial sums that ``all_reduce`` adds up.
2. A 2-stage pipeline of the same FFN, 2-way tensor parallel per stage: stage 0 on
   devices 0-1, stage 1 on devices 2-3. Only the weights are pinned to their stage's
   devices; the forward pass has no explicit transfer: the dispatcher's transfer-if-needed
   step moves the activation from stage 0 to stage 1.

Prints every transfer and the max error against torch; exits non-zero if an error is
above tolerance.

    python examples/sharded_ffn.py [--seed N]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor

TOLERANCE = 1e-5


def ffn(x, w_up, w_down):
    """The FFN forward, written once for plain and sharded weights."""
    h = ops.elementwise(F.silu, ops.linear(x, w_up))
    return ops.all_reduce(ops.linear(h, w_down)) if isinstance(w_down, SplitPrimitiveTensor) else ops.linear(h, w_down)


def shard_weights(w_up, w_down, devices):
    return (
        SplitPrimitiveTensor(shard_dim=0, ts=w_up, devices=devices, pinned=True),  # column-parallel
        SplitPrimitiveTensor(shard_dim=1, ts=w_down, devices=devices, pinned=True),  # row-parallel
    )


def report(title: str, log, result, expected) -> float:
    err = (ops.unshard(result) - expected).abs().max().item()
    print(f"\n== {title}")
    print(f"result: {result!r}")
    print(f"transfers ({len(log)}, {log.total_bytes()} bytes):")
    print("  " + str(log).replace("\n", "\n  "))
    print(f"max abs error vs unsharded torch: {err:.3g}")
    return err


def run(seed: int = 0) -> bool:
    torch.manual_seed(seed)
    batch, dim, hidden = 4, 32, 64
    x = torch.randn(batch, dim)
    layers = [(torch.randn(hidden, dim) / dim**0.5, torch.randn(dim, hidden) / hidden**0.5) for _ in range(2)]

    # 1. Four-way tensor parallel, one FFN.
    expected = ffn(x, *layers[0])
    w_up, w_down = shard_weights(*layers[0], devices=[0, 1, 2, 3])
    with ops.record_transfers() as log:
        y = ffn(ReplicatedTensor(ts=x, devices=[0, 1, 2, 3]), w_up, w_down)
    errors = [report("tensor parallel, 4 devices", log, y, expected)]

    # 2. Two pipeline stages of 2-way tensor parallel FFNs; no explicit transfers below.
    expected = ffn(ffn(x, *layers[0]), *layers[1])
    stages = [shard_weights(*layers[s], devices=[2 * s, 2 * s + 1]) for s in range(2)]
    with ops.record_transfers() as log:
        h = ReplicatedTensor(ts=x, devices=[0, 1])  # activations are not pinned
        for w_up, w_down in stages:
            h = ffn(h, w_up, w_down)
    errors.append(report("pipeline, 2 stages x 2 devices", log, h, expected))

    ok = all(e <= TOLERANCE for e in errors)
    print(f"\n{'OK' if ok else 'FAILED'}: max error {max(errors):.3g} (tolerance {TOLERANCE})")
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="random seed for weights and input (default 0)")
    sys.exit(0 if run(parser.parse_args().seed) else 1)
