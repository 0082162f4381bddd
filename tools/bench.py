"""Side-by-side benchmarks: sharktank.ops against plain torch loops, compiled against eager,
sharded against one device, and the data collectives move against the optimal figures.

Each timed row runs both sides in the same run, interleaved, over several rounds, and
prints the median ratio with its min-max (this machine is shared and noisy). Byte and
transfer figures are exact. Everything also goes to JSON, with a last table of each
target, measured / target: the targets are judged on figures from this run; the public
package's toy-llama-3l figures come from another run and are printed beside ours, not judged.

    python tools/bench.py [--rounds 15] [--quick] [--skip-compiled] [--artifacts DIR] [--json bench.json]

Parts (each can be skipped with ``--skip-PART``):
- eager: dispatch overhead of a 4-way tensor-parallel FFN forward, a 3-shard matmul (4x6 by
  6x9, replicated x split), a split + split add, all_gather and all_reduce over 4 shards,
  each against a plain per-shard torch loop doing the same arithmetic and the same copies
  (a transfer is a copy in eager mode);
- import: import time of ``sharktank.ops`` above ``import torch`` (fresh interpreters);
- compiled: the toy Llama compiled for one CPU device against eager torch (decode time per
  token, prefill tokens/s), tp2, pp2 and tp2xpp2 compiled against one device compiled,
  export and compile times and the data a decode step moves (``tools/bench_compiled.py``);
- reference: ``toy-llama-3l`` (the public sharktank package's toy Llama shapes, float16)
  exported, compiled and run at tp1 and pp=2, on the local-task and local-sync drivers,
  next to that package's figures (``tools/bench_reference.py``);
- collectives: transfers and bytes per device of all_gather, reduce_scatter and all_reduce
  for N = 2, 4, 8, eager and in the exported MLIR, against the bandwidth-optimal figures,
  and coalesced transfers against one transfer per tensor (``tools/bench_collectives.py``).

``--profile ROW`` prints a cProfile summary of the sharktank side of an eager row.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor, split_sizes

from bench_reference import PUBLIC
from bench_timing import side_by_side

# name -> (comparison, value): pass/fail goals, each judged on figures measured in this run.
# The 3-shard matmul target: the public sharktank package took about 10x the plain loop on
# these shapes; the target is 5x faster than that.
TARGETS: dict[str, tuple[str, float]] = {
    "tp_ffn": ("<=", 1.5),
    "matmul_3shard": ("<=", 2.0),
    "import_ops_s": ("<=", 0.3),
    "compiled_decode_speedup": (">=", 2.0),
    "tp2pp2_decode_vs_tp1": ("<=", 1.3),
    "tp2pp2_prefill_vs_tp1": ("<=", 1.3),
    # toy-llama-3l (tools/bench_reference.py): compiled decode against eager torch decode,
    # both timed in this run (the goal of compiled_decode_speedup), and pp=2 decode moving
    # only the hidden state across the boundary plus the position stage 2 reads.
    "t3l_decode_speedup_vs_eager": (">=", 2.0),
    "t3l_pp2_decode_transfers": ("<=", 2),
}

# name -> (comparison, value) from the public package's toy-llama-3l figures, measured in
# another run (bench_reference.PUBLIC): export + compile 3x faster than its 14.3 + 7.4 s,
# prefill and decode no slower. That package cannot run here side by side, so these rows
# are printed for information, never judged.
ANOTHER_RUN: dict[str, tuple[str, float]] = {
    # Two quantities: the CLI's wall time (starting Python, importing torch) when this run
    # built the artifact, and the in-process export + compile seconds (from its --json, or
    # from the manifest of a reused --artifacts one).
    "t3l_export_compile_cli_wall_s": ("<=", round((PUBLIC["export_s"] + PUBLIC["compile_s"]) / 3, 2)),
    "t3l_export_compile_in_process_s": ("<=", round((PUBLIC["export_s"] + PUBLIC["compile_s"]) / 3, 2)),
    "t3l_prefill_ms": ("<=", PUBLIC["prefill_ms"]),
    "t3l_decode_ms": ("<=", PUBLIC["decode_ms"]),
    "t3l_prefill_ms_local_sync": ("<=", PUBLIC["prefill_ms"]),
    "t3l_decode_ms_local_sync": ("<=", PUBLIC["decode_ms"]),
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


def eager_cases() -> dict[str, tuple[Callable, Callable]]:
    """Each row's (sharktank, plain torch) pair."""
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

    a = ReplicatedTensor(ts=torch.randn(4, 6), shard_count=3)
    b = SplitPrimitiveTensor(shard_dim=1, ts=torch.randn(6, 9), shard_count=3)
    s1 = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(8, 16), shard_count=n)
    s2 = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(8, 16), shard_count=n)
    u = UnreducedTensor(ts=[torch.randn(8, 16) for _ in range(n)])
    return {
        "tp_ffn": (ours_ffn, plain_ffn),
        "matmul_3shard": (lambda: ops.matmul(a, b), lambda: [torch.matmul(p, q) for p, q in zip(a.shards, b.shards)]),
        "add_split": (lambda: ops.add(s1, s2), lambda: [p + q for p, q in zip(s1.shards, s2.shards)]),
        "all_gather_4": (lambda: ops.all_gather(s1), lambda: plain_all_gather(list(s1.shards), 0)),
        "all_reduce_4": (lambda: ops.all_reduce(u), lambda: plain_all_reduce(list(u.shards))),
    }


def eager_rows(rounds: int) -> dict:
    return {name: side_by_side(ours, plain, rounds) for name, (ours, plain) in eager_cases().items()}


def profile_row(name: str, calls: int = 2000, top: int = 25) -> str:
    """cProfile summary (by own time) of ``calls`` runs of the sharktank side of a row."""
    ours, _ = eager_cases()[name]
    ours()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        ours()
    prof.disable()
    out = __import__("io").StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    return out.getvalue()


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


# --- printing --------------------------------------------------------------------------------
def _target(name: str) -> str:
    return f"{TARGETS[name][0]} {TARGETS[name][1]}" if name in TARGETS else ""


def _ratio_line(name: str, a: float, b: float, r: dict, width: int = 22) -> str:
    return f"{name:<{width}} {a:11.1f} {b:11.1f} {r['ratio']:7.2f} {r['ratio_min']:6.2f}-{r['ratio_max']:<6.2f} {_target(name):>8}"


def print_eager(rows: dict) -> None:
    print("== eager dispatch: sharktank.ops vs a plain per-shard torch loop (ratio = ops / plain)")
    print(f"{'row':<22} {'ops us':>11} {'plain us':>11} {'ratio':>7} {'min-max':>13} {'target':>8}")
    for name, r in rows.items():
        print(_ratio_line(name, r["ours_us"], r["plain_us"], r))


def print_compiled(c: dict) -> None:
    print(f"\n== compiled (IREE llvm-cpu, local-task; *_sync rows on local-sync) {c['model']}, batch 1, prompt {c['prompt_len']}, cache {c['max_seq_len']}")
    print(f"{'row':<22} {'eager':>11} {'compiled':>11} {'ratio':>7} {'min-max':>13} {'target':>8}")
    d, p = c["decode_speedup_vs_eager"], c["prefill_speedup_vs_eager"]
    print(_ratio_line("compiled_decode_speedup", d["a_us"], d["b_us"], d, 22) + "   (us per token; ratio = eager / compiled)")
    tps = c["prefill_tokens_per_s"]
    print(
        f"{'compiled_prefill_speedup':<22} {tps['eager']:11.0f} {tps['tp1']:11.0f} {p['ratio']:7.2f} "
        f"{p['ratio_min']:6.2f}-{p['ratio_max']:<6.2f} {'':>8}   (tokens/s; ratio = eager time / compiled time)"
    )
    print(f"\n{'sharded / one device':<22} {'sharded us':>11} {'1 device us':>11} {'ratio':>7} {'min-max':>13} {'target':>8}")
    for n, r in c["sharded_vs_tp1"].items():
        for kind in ("decode", "prefill"):
            print(_ratio_line(f"{n}_{kind}_vs_tp1", r[kind]["a_us"], r[kind]["b_us"], r[kind]))
    print(
        f"\n{'config':<8} {'devices':>7} {'export s':>9} {'compile s':>9}  {'decode: transfers':>17} {'bytes':>6} "
        f"{'max sent/dev':>12} {'dispatches':>10} {'us/dispatch':>11}  max |compiled-eager|"
    )
    for n, b in c["build"].items():
        m = b["decode_moves"]
        reused = " (reused artifact: times from its manifest)" if b["reused"] else ""
        per = c["decode_ms_per_token"][n] * 1e3 / m["dispatches"]
        print(
            f"{n:<8} {b['devices']:>7} {b['export_s']:9.1f} {b['compile_s']:9.1f}  {m['transfers']:>17} {m['bytes']:>6} "
            f"{m['max_sent_per_device']:>12} {m['dispatches']:>10} {per:>11.1f}  {c['max_abs_diff_vs_eager'][n]:.1e}{reused}"
        )


def print_collectives(rows: list[dict]) -> None:
    print("\n== collectives: transfers and bytes per device (fraction of the tensor), eager | exported MLIR")
    print(f"{'op':<15} {'N':>2} {'transfers':>14} {'sent min-max':>23} {'received min-max':>23} {'optimal':>8}")
    for r in rows:
        e, m = r["eager"], r.get("mlir")
        t = f"{e['transfers']}|{m['transfers'] if m else '-'}"
        sent = f"{e['sent_min']:.3f}-{e['sent_max']:.3f}|" + (f"{m['sent_min']:.3f}-{m['sent_max']:.3f}" if m else "-")
        recv = f"{e['received_min']:.3f}-{e['received_max']:.3f}|" + (f"{m['received_min']:.3f}-{m['received_max']:.3f}" if m else "-")
        ok = "ok" if r["met"] else "NOT MET"
        print(f"{r['op']:<15} {r['n']:>2} {t:>14} {sent:>23} {recv:>23} {r['optimal']:8.3f}  {r['optimal_transfers']} transfers, {ok}")


def print_coalesce(rows: list[dict]) -> None:
    print("\n== coalesced transfers: transfer count (expected) eager | exported MLIR; max bytes a device sends; eager us")
    for r in rows:
        first, cap = r["small_buckets"]
        print(f"{r['case']}: {r['tensors']} tensors, {r['shard_bytes']} bytes per shard set")
        for key, label in (("per_tensor", "one per tensor"), ("coalesced", "coalesced 1MiB/25MiB"), ("coalesced_small", f"coalesced {first >> 10}KiB/{cap >> 10}KiB")):
            v = r[key]
            mlir = f"{v['mlir']:>4}" if "mlir" in v else "   -"
            sent = f"{v['eager_max_sent']}|{v.get('mlir_max_sent', '-')}"
            print(f"  {label:<22} {v['eager']:>4} ({v['expected']:>4}) | {mlir}  {sent:>13}  {v['eager_us']:9.1f}")


def summary(results: dict) -> list[dict]:
    """Each target with its measured figure (median; min-max where timed)."""
    got: dict[str, tuple[float, float | None, float | None]] = {}
    for name, r in results.get("eager", {}).items():
        got[name] = (r["ratio"], r["ratio_min"], r["ratio_max"])
    if "import" in results:
        got["import_ops_s"] = (results["import"]["import_ops_s"], None, None)
    if "reference" in results:
        r = results["reference"]
        if r["export_compile_cli_wall_s"] is not None:  # None: a reused artifact
            got["t3l_export_compile_cli_wall_s"] = (r["export_compile_cli_wall_s"], None, None)
        got["t3l_export_compile_in_process_s"] = (r["export_compile_in_process_s"], None, None)
        got["t3l_decode_speedup_vs_eager"] = (r["eager_decode_ms"] / r["tp1"]["decode_ms"], None, None)
        got["t3l_prefill_ms"] = (r["tp1"]["prefill_ms"], None, None)
        got["t3l_decode_ms"] = (r["tp1"]["decode_ms"], r["tp1"]["decode_ms_min"], r["tp1"]["decode_ms_max"])
        got["t3l_prefill_ms_local_sync"] = (r["tp1_sync"]["prefill_ms"], None, None)
        got["t3l_decode_ms_local_sync"] = (r["tp1_sync"]["decode_ms"], r["tp1_sync"]["decode_ms_min"], r["tp1_sync"]["decode_ms_max"])
        got["t3l_pp2_decode_transfers"] = (float(r["builds"]["pp2"]["transfers"]["decode_bs1"]), None, None)
    if "compiled" in results:
        d = results["compiled"]["decode_speedup_vs_eager"]
        got["compiled_decode_speedup"] = (d["ratio"], d["ratio_min"], d["ratio_max"])
        for kind in ("decode", "prefill"):
            r = results["compiled"]["sharded_vs_tp1"].get("tp2pp2", {}).get(kind)
            if r:
                got[f"tp2pp2_{kind}_vs_tp1"] = (r["ratio"], r["ratio_min"], r["ratio_max"])
    out = []
    for goals, judged in ((TARGETS, True), (ANOTHER_RUN, False)):
        for name, (op, value) in goals.items():
            if name in got:
                m, lo, hi = got[name]
                met = m <= value if op == "<=" else m >= value
                row = {"target": name, "measured": m, "min": lo, "max": hi, "goal": f"{op} {value}", "judged": judged}
                # An ANOTHER_RUN row says how it compares, but is no pass/fail judgement.
                out.append({**row, "met": met} if judged else {**row, "met": None, "compares": met, "reference": "another run"})
    if "collectives" in results:
        rows = results["collectives"]
        out.append({"target": "collectives_bandwidth_optimal", "measured": sum(r["met"] for r in rows), "min": None, "max": None,
                    "goal": f"{len(rows)}/{len(rows)} rows", "judged": True, "met": all(r["met"] for r in rows)})
    if "coalesce" in results:
        ok = all(r[k]["eager"] == r[k]["expected"] and r[k].get("mlir", r[k]["expected"]) == r[k]["expected"]
                 for r in results["coalesce"] for k in ("per_tensor", "coalesced", "coalesced_small"))
        before = sum(r["per_tensor"].get("mlir", r["per_tensor"]["eager"]) for r in results["coalesce"])
        after = sum(r["coalesced"].get("mlir", r["coalesced"]["eager"]) for r in results["coalesce"])
        out.append({"target": "coalesced_transfers", "measured": f"{before} -> {after}", "min": None, "max": None,
                    "goal": "one per bucket per pair", "judged": True, "met": ok})
    return out


def print_summary(rows: list[dict]) -> None:
    print("\n== targets: measured / target (judged on figures from this run; rows against another run's constant are not judged)")
    for r in rows:
        m = r["measured"]
        m = f"{m:.3f}" if isinstance(m, float) else str(m)
        spread = f" ({r['min']:.2f}-{r['max']:.2f})" if r["min"] is not None else ""
        if r["judged"]:
            verdict = "met" if r["met"] else "NOT MET"
        else:
            verdict = f"{'within' if r['compares'] else 'outside'} it; constant from another run, not judged"
        print(f"{r['target']:<32} {m + spread:>22} / {r['goal']:<10} {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds per timed row (default 15, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, N=2,4 only, compiled tp1 and tp2xpp2 only")
    for part in ("eager", "import", "compiled", "reference", "collectives"):
        parser.add_argument(f"--skip-{part}", action="store_true", help=f"skip the {part} rows")
    parser.add_argument("--no-export", action="store_true", help="collective rows from eager transfers only (no MLIR)")
    parser.add_argument("--artifacts", help="keep compiled artifacts in this directory and reuse them (default: a temporary one)")
    parser.add_argument("--profile", metavar="ROW", help="print a cProfile summary of this eager row's sharktank side and exit")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.profile:
        print(profile_row(args.profile))
        return 0
    rounds = args.rounds or (5 if args.quick else 15)
    results: dict = {"targets": TARGETS, "rounds": rounds}
    t0 = time.perf_counter()
    if not args.skip_eager:
        results["eager"] = eager_rows(rounds)
        print_eager(results["eager"])
    if not args.skip_import:
        imp = results["import"] = import_rows()
        print(
            f"\nimport torch {imp['import_torch_s']:.3f} s; import sharktank.ops after it adds "
            f"{imp['import_ops_s']:.3f} s (target {_target('import_ops_s')} s)"
        )
    if not args.skip_compiled:
        from bench_compiled import CONFIGS, compiled_rows

        names = ["tp1", "tp2pp2"] if args.quick else list(CONFIGS)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(args.artifacts or tmp)
            root.mkdir(parents=True, exist_ok=True)
            results["compiled"] = compiled_rows(root, names, rounds)
        print_compiled(results["compiled"])
    if not args.skip_reference:
        from bench_reference import print_reference, reference_rows

        with tempfile.TemporaryDirectory() as tmp:
            root = Path(args.artifacts or tmp)
            root.mkdir(parents=True, exist_ok=True)
            results["reference"] = reference_rows(root, rounds)
        print_reference(results["reference"])
    if not args.skip_collectives:
        from bench_collectives import coalesce_rows, collective_rows

        results["collectives"] = collective_rows((2, 4) if args.quick else (2, 4, 8), export=not args.no_export)
        print_collectives(results["collectives"])
        results["coalesce"] = coalesce_rows(export=not args.no_export, rounds=rounds)
        print_coalesce(results["coalesce"])
    results["summary"] = summary(results)
    print_summary(results["summary"])
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
