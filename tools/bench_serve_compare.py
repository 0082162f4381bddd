"""Two `sharktank serve` sides (checkouts and artifacts) measured by bench_serve in interleaved rounds.

    python tools/bench_serve_compare.py --side NAME=CHECKOUT:ARTIFACT --side ... [--rounds 3] [--json FILE]

Each round runs every side once (the order alternates between rounds), each side with its own
checkout's ``tools/bench_serve.py`` server (``sharktank serve`` from that checkout). Prints, per
side and client count, the median and min-max over rounds of tokens/s and TTFT p50/p99, then
bench_serve's throughput target on the medians (the burst section is bench_serve's own).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import httpx


def load_bench(checkout: str):
    spec = importlib.util.spec_from_file_location(f"bench_serve_{abs(hash(checkout))}", Path(checkout) / "tools" / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", action="append", required=True, help="NAME=CHECKOUT:ARTIFACT")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sides = []
    for s in args.side:
        name, rest = s.split("=", 1)
        checkout, artifact = rest.split(":", 1)
        sides.append((name, load_bench(checkout), artifact))
    counts = [int(c) for c in args.clients.split(",")]
    results: dict[str, list[list[dict]]] = {name: [] for name, _, _ in sides}
    for r in range(args.rounds):
        for name, bench, artifact in sides if r % 2 == 0 else sides[::-1]:
            with bench.served(artifact) as url:
                model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                # Warm-up: every client count once, so each decode batch function has run before timing.
                for c in counts:
                    asyncio.run(bench.level(url, model, c, c, args.max_tokens))
                rows = [asyncio.run(bench.level(url, model, c, max(args.requests, c), args.max_tokens)) for c in counts]
            results[name].append(rows)
            print(f"round {r + 1} {name}\n{bench.table(rows)}", flush=True)
    print(f"\nmedian (min-max) over {args.rounds} rounds")
    print(f"{'side':>8} {'clients':>7} {'tokens/s':>22} {'TTFT p50 ms':>22} {'TTFT p99 ms':>22}")
    summary = {}
    for name, bench, _ in sides:
        med = []
        for i, c in enumerate(counts):
            cell = {}
            for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms"):
                xs = [rows[i][key] for rows in results[name]]
                cell[key] = statistics.median(xs)
                cell[key + "_range"] = (min(xs), max(xs))
            med.append({"clients": c, **cell})
            f = lambda k: f"{cell[k]:.1f} ({cell[k + '_range'][0]:.1f}-{cell[k + '_range'][1]:.1f})"
            print(f"{name:>8} {c:>7} {f('tokens_per_s'):>22} {f('ttft_p50_ms'):>22} {f('ttft_p99_ms'):>22}")
        checks = bench.targets(med)
        for t in checks:
            print(f"{name:>8}: {t['target']}: {t['measured']} -> {'met' if t['met'] else 'NOT met'}")
        summary[name] = {"median": med, "targets": checks, "rounds": results[name]}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
