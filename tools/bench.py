"""Side-by-side benchmarks: sharktank.ops against the same work written as plain torch loops.

Each row times both sides in the same run, interleaved, over several rounds, and prints the
median ratio with its min-max (this machine is shared and noisy). Figures also go to JSON.

    python tools/bench.py [--rounds 15] [--json bench.json]

Rows:
- eager dispatch overhead: a 4-way tensor-parallel FFN forward, a 3-shard matmul (4x6 by
  6x9, replicated x split), a split + split add, all_gather and all_reduce over 4 shards,
  each against a plain per-shard torch loop doing the same arithmetic and the same copies
  (a transfer is a copy in eager mode);
- import time of ``sharktank.ops`` above ``import torch`` (fresh interpreters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor, split_sizes

TARGETS = {"tp_ffn": 1.5, "import_ops_s": 0.3}


def _time(fn: Callable, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def side_by_side(ours: Callable, plain: Callable, rounds: int, inner: int = 200) -> dict:
    ours(), plain()  # warm caches
    a, b = [], []
    for _ in range(rounds):
        a.append(_time(ours, inner))
        b.append(_time(plain, inner))
    ratios = sorted(x / y for x, y in zip(a, b))
    return {
        "ours_us": statistics.median(a) * 1e6,
        "plain_us": statistics.median(b) * 1e6,
        "ratio": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
    }


def plain_all_reduce(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reduce-scatter + all-gather over flattened pieces, copies standing for transfers."""
    n = len(parts)
    shape = parts[0].shape
    sizes = split_sizes(parts[0].numel(), n)
    pieces = [torch.split(p.reshape(-1), sizes) for p in parts]
    reduced = []
    for j in range(n):
        acc = None
        for i in range(n):
            p = pieces[i][j] if i == j else pieces[i][j].clone()
            acc = p if acc is None else acc + p
        reduced.append(acc)
    return [torch.cat([r if i == j else r.clone() for i, r in enumerate(reduced)]).reshape(shape) for j in range(n)]


def plain_all_gather(shards: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    return [torch.cat([s if i == j else s.clone() for i, s in enumerate(shards)], dim) for j in range(len(shards))]


def eager_rows(rounds: int) -> dict:
    rows = {}
    n = 4
    x = torch.randn(4, 32)
    w1, w2 = torch.randn(64, 32), torch.randn(32, 64)
    xs = ReplicatedTensor(ts=x, shard_count=n)
    w1s = SplitPrimitiveTensor(shard_dim=0, ts=w1, shard_count=n)
    w2s = SplitPrimitiveTensor(shard_dim=1, ts=w2, shard_count=n)

    def ours_ffn():
        return ops.all_reduce(ops.linear(ops.elementwise(F.silu, ops.linear(xs, w1s)), w2s))

    def plain_ffn():
        partial = [F.linear(F.silu(F.linear(x, a)), b) for a, b in zip(w1s.shards, w2s.shards)]
        return plain_all_reduce(partial)

    rows["tp_ffn"] = side_by_side(ours_ffn, plain_ffn, rounds)

    a = ReplicatedTensor(ts=torch.randn(4, 6), shard_count=3)
    b = SplitPrimitiveTensor(shard_dim=1, ts=torch.randn(6, 9), shard_count=3)
    rows["matmul_3shard"] = side_by_side(
        lambda: ops.matmul(a, b), lambda: [torch.matmul(p, q) for p, q in zip(a.shards, b.shards)], rounds
    )

    s1 = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(8, 16), shard_count=n)
    s2 = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(8, 16), shard_count=n)
    rows["add_split"] = side_by_side(lambda: ops.add(s1, s2), lambda: [p + q for p, q in zip(s1.shards, s2.shards)], rounds)
    rows["all_gather_4"] = side_by_side(lambda: ops.all_gather(s1), lambda: plain_all_gather(list(s1.shards), 0), rounds)
    u = UnreducedTensor(ts=[torch.randn(8, 16) for _ in range(n)])
    rows["all_reduce_4"] = side_by_side(lambda: ops.all_reduce(u), lambda: plain_all_reduce(list(u.shards)), rounds)
    return rows


def import_rows(repeats: int = 5) -> dict:
    """Median over fresh interpreters of: import torch, then import sharktank.ops after it."""
    code = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        "import sharktank.ops; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)"
    )
    runs = [tuple(map(float, subprocess.check_output([sys.executable, "-c", code]).split())) for _ in range(repeats)]
    return {
        "import_torch_s": statistics.median(r[0] for r in runs),
        "import_ops_s": statistics.median(r[1] for r in runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds per row (median and min-max over them)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    rows = eager_rows(args.rounds)
    imports = import_rows()
    print(f"{'row':<16} {'ours us':>9} {'plain us':>9} {'ratio':>7} {'min-max':>13} {'target':>8}")
    for name, r in rows.items():
        target = f"<= {TARGETS[name]}" if name in TARGETS else ""
        print(
            f"{name:<16} {r['ours_us']:9.1f} {r['plain_us']:9.1f} {r['ratio']:7.2f} "
            f"{r['ratio_min']:6.2f}-{r['ratio_max']:<6.2f} {target:>8}"
        )
    print(
        f"\nimport torch {imports['import_torch_s']:.3f} s; import sharktank.ops after it adds "
        f"{imports['import_ops_s']:.3f} s (target <= {TARGETS['import_ops_s']} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"eager": rows, "import": imports, "targets": TARGETS}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
