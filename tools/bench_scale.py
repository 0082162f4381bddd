"""Real-size figures: export, compile and run a generated checkpoint of a published Llama shape,
against the limits measured in the same run.

    python tools/bench_scale.py [--shape 1b|8b] [--tp 1,2] [--rounds 3] [--steps 16] [--work DIR] [--json FILE]

Per tensor-parallel size: export (``--no-compile``) and compile wall seconds and peak RSS, the
parameter bytes written, run peak RSS, time to first token (``run``'s ``first_token_s``: from
the process's start, interpreter and imports included, to the first token's logits; a first
run that hashes the archives, then the median of later runs, which find them in the
verification record), and decode ms/token. Measured in the same run, interleaved with our runs round by
round: transformers eager decode ms/token (bfloat16, all cores; 1B only: the 8B in eager
torch does not fit beside anything on a 24 GiB machine) and this machine's read bandwidth,
which gives the memory-read limit (weight bytes a decode step reads / bandwidth).

Every process is measured with ``/usr/bin/time -f %M`` (peak RSS, KiB). Checkpoints come from
``tools/make_checkpoint.py`` and are cached outside the repo (``~/.cache/sharktank``). Targets
(issue 13): export peak ≤ 1.5 GiB + 2× the largest tensor; run peak ≤ 1.2× the parameter
bytes; first token ≤ 3 s + one read of the parameters; decode ≤ 1.1× the limit and ≥ 1.8×
faster than transformers. Each row prints its figure, the target and whether it is met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_limits import read_bandwidth_gbs, weight_bytes_per_token  # noqa: E402
from make_checkpoint import cache_root, cached_checkpoint  # noqa: E402

SHAPES = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}
PROMPT = ",".join(str(t) for t in (128000, 791, 4062, 14198, 39935, 35308, 927, 279))  # 8 ids


def timed(args: list[str], **kw) -> tuple[subprocess.CompletedProcess, float, int]:
    """``(process, wall seconds, peak RSS bytes)`` of one command."""
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB %M", *args], capture_output=True, text=True, **kw)
    wall = time.perf_counter() - t0
    peak = [line for line in p.stderr.splitlines() if line.startswith("PEAK_RSS_KB ")]
    if p.returncode != 0 or not peak:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(args)}\n{p.stderr[-3000:]}")
    return p, wall, int(peak[-1].split()[1]) * 1024


def sharktank(*args: str) -> list[str]:
    return [sys.executable, "-m", "sharktank.cli", *args]


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def transformers_round(checkpoint: Path, steps: int) -> float:
    code = (
        f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import bench_limits; "
        f"print(json.dumps(bench_limits.transformers_decode_ms({str(checkpoint)!r}, steps={steps}, rounds=1)))"
    )
    p, _, _ = timed([sys.executable, "-c", code])
    return json.loads(p.stdout.strip().splitlines()[-1])["median"]


def build(checkpoint: Path, out: Path, tp: int, max_seq_len: int, extra: tuple[str, ...] = ()) -> dict:
    """Export (``extra``: more export flags) and compile ``checkpoint`` into ``out``, afresh."""
    if out.exists():
        shutil.rmtree(out)
    _, export_s, export_peak = timed(sharktank("export", "--model", str(checkpoint), "--tp", str(tp), "--max-seq-len", str(max_seq_len), *extra, "--no-compile", "--output-dir", str(out)))
    _, compile_s, compile_peak = timed(sharktank("compile", str(out)))
    manifest = json.loads((out / "manifest.json").read_text())
    return {
        "export_wall_s": export_s, "export_peak_rss": export_peak, "compile_wall_s": compile_s, "compile_peak_rss": compile_peak,
        "parameter_bytes": sum(f["size"] for f in manifest["parameters"]["files"].values()),
    }


def read_seconds(out: Path) -> float:
    """One read of the parameter archives (as ``run``'s loading reads them; page cache as it is)."""
    t0 = time.perf_counter()
    for f in sorted(out.glob("*.irpa")):
        with open(f, "rb") as fh:
            while fh.readinto(buf := bytearray(1 << 24)):
                pass
    return time.perf_counter() - t0


def run_once(out: Path, new_tokens: int) -> tuple[dict, float, int]:
    p, wall, peak = timed(sharktank("run", str(out), "--tokens", PROMPT, "--max-new-tokens", str(new_tokens), "--json"))
    return json.loads(p.stdout.strip().splitlines()[-1]), wall, peak


def row(name: str, value: float, unit: str, target: float | None = None, *, at_most: bool = True, note: str = "") -> dict:
    met = None if target is None else (value <= target if at_most else value >= target)
    judged = "" if target is None else f"{'<=' if at_most else '>='} {target:.3g} {'met' if met else 'NOT met'}"
    print(f"  {name:<52} {value:>10.3f} {unit:<9} {judged} {note}".rstrip())
    return {"row": name, "value": value, "unit": unit, "target": target, "met": met, "note": note}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--tp", default=None, help="tensor-parallel sizes, comma-separated (default 1,2 for 1b; 2 for 8b)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of our decode and the references (default 3)")
    parser.add_argument("--steps", type=int, default=16, help="decode tokens per round (default 16)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--work", type=Path, default=None, help="where artifacts are built (default: the cache dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    args = parser.parse_args(argv)
    tps = [int(x) for x in (args.tp or ("1,2" if args.shape == "1b" else "2")).split(",")]
    checkpoint = cached_checkpoint(SHAPES[args.shape], "bfloat16")
    config = json.loads((checkpoint / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings"))
    weight_bytes = weight_bytes_per_token(config, 2, tied)
    largest = config["vocab_size"] * config["hidden_size"] * 2
    work = args.work or cache_root() / "bench-scale"
    print(f"== scale: {SHAPES[args.shape]} bfloat16 ({checkpoint}), {os.cpu_count()} cores")
    print(f"  checkpoint {sum(f.stat().st_size for f in checkpoint.glob('*.safetensors')) / 1e9:.2f} GB, largest tensor {largest / 1e9:.3f} GB, "
          f"a decode step reads {weight_bytes / 1e9:.3f} GB of weights")
    rows: dict[str, list[dict]] = {}
    built = {tp: build(checkpoint, work / f"{args.shape}-tp{tp}", tp, args.max_seq_len) for tp in tps}
    ours: dict[int, list[float]] = {tp: [] for tp in tps}
    first_token: dict[int, list[float]] = {tp: [] for tp in tps}
    run_peak: dict[int, list[int]] = {tp: [] for tp in tps}
    first_hashing: dict[int, float] = {}
    reads: dict[int, list[float]] = {tp: [] for tp in tps}
    theirs: list[float] = []
    bandwidth: list[float] = []
    for tp in tps:  # the first run of each artifact hashes its archives and records them
        first_hashing[tp] = run_once(work / f"{args.shape}-tp{tp}", 1)[0]["first_token_s"]
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth_gbs(rounds=3)["median"])
        for tp in tps:
            out = work / f"{args.shape}-tp{tp}"
            reads[tp].append(read_seconds(out))
            first_token[tp].append(run_once(out, 1)[0]["first_token_s"])
            result, _, peak = run_once(out, args.steps + 1)
            ours[tp].append(result["decode_ms_per_token"]["median"])
            run_peak[tp].append(peak)
        if args.shape == "1b":
            theirs.append(transformers_round(checkpoint, args.steps))
        print(f"  round {r + 1}/{args.rounds}: ours {[round(ours[tp][-1], 1) for tp in tps]} ms/token"
              + (f", transformers {theirs[-1]:.1f}" if theirs else "") + f", bandwidth {bandwidth[-1]:.2f} GB/s", flush=True)
    bw = stats(bandwidth)
    limit_ms = weight_bytes / (bw["median"] * 1e9) * 1e3
    print(f"  read bandwidth {bw['median']:.2f} GB/s (min {bw['min']:.2f}, max {bw['max']:.2f}); memory-read limit {limit_ms:.1f} ms/token")
    if theirs:
        t = stats(theirs)
        print(f"  transformers eager bfloat16 decode {t['median']:.1f} ms/token (min {t['min']:.1f}, max {t['max']:.1f})")
    gib = 2**30
    for tp in tps:
        b = built[tp]
        d = stats(ours[tp])
        ft = stats(first_token[tp])
        read = statistics.median(reads[tp])
        print(f"-- tp{tp}: decode {d['median']:.1f} ms/token (min {d['min']:.1f}, max {d['max']:.1f}) over {args.rounds} rounds of {args.steps}")
        rows[f"tp{tp}"] = [
            row("export wall (--no-compile), s", b["export_wall_s"], "s"),
            row("compile wall, s", b["compile_wall_s"], "s"),
            row("export peak RSS, GiB", b["export_peak_rss"] / gib, "GiB", 1.5 + 2 * largest / gib),
            row("compile peak RSS, GiB", b["compile_peak_rss"] / gib, "GiB"),
            row("parameter bytes, GB", b["parameter_bytes"] / 1e9, "GB"),
            row("run peak RSS / parameter bytes", max(run_peak[tp]) / b["parameter_bytes"], "x", 1.2, note=f"({max(run_peak[tp]) / gib:.2f} GiB)"),
            row("first token, first run (hashes the archives), s", first_hashing[tp], "s"),
            row("first token, later runs (median), s", ft["median"], "s", 3 + read, note=f"(range {ft['min']:.2f}-{ft['max']:.2f}; one read of the archives {read:.2f} s)"),
            row("decode / memory-read limit", d["median"] / limit_ms, "x", 1.1),
        ]
        if theirs:
            rows[f"tp{tp}"].append(row("transformers decode / ours (same rounds)", statistics.median(theirs) / d["median"], "x", 1.8, at_most=False))
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "bandwidth": bw, "limit_ms": limit_ms, "transformers": theirs, "rows": rows, "built": built}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
