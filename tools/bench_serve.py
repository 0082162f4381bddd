"""Serving throughput and latency: `sharktank serve` under 1, 4 and 8 concurrent streaming clients.

    python tools/bench_serve.py ARTIFACT_DIR [--clients 1,4,8] [--requests 16] [--max-tokens 32] [--json FILE]

Starts ``sharktank serve ARTIFACT_DIR`` on 127.0.0.1 (a free port) in a subprocess, sends one
warm-up request, then for each client count keeps that many streaming greedy completions in
flight until ``--requests`` have finished. Per level: generated tokens (the usage chunk's
``completion_tokens``) over the level's wall time, and the time to first token of each request
(from sending it to the first chunk carrying a token), p50 and p99. Every request and the
server's start are bounded by timeouts; the server is stopped on exit, also on failure.

Targets (issue 15): 8 clients reach ≥ 4× the aggregate tokens/s of 1 client; TTFT p99 at
8 clients ≤ 3× the TTFT p50 of 1 client. The artifact should export batch size 8
(``--batch-sizes 1,8``) for the engine to batch eight requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT_S = 120


@contextmanager
def served(artifact: str, *options: str, start_timeout: float = 180):
    """The base URL of ``sharktank serve artifact --port 0 *options`` once it says it is ready; stopped on exit."""
    cmd = [sys.executable, "-m", "sharktank.cli", "serve", artifact, "--port", "0", *options]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + start_timeout
        while not any(" at http://" in line for line in lines):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sharktank serve did not become ready (exit {p.poll()}): {''.join(lines)[-2000:]}")
            time.sleep(0.05)
        yield next(line for line in lines if " at http://" in line).split(" at ")[1].split("/v1")[0]
    finally:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, completion tokens) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    first, tokens = None, None
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"request failed ({r.status_code}): {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"the server reported an error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"][0].get("token_ids"):
                first = time.perf_counter() - t0
    return first, tokens


async def level(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` completions, ``clients`` in flight at a time."""
    todo = iter(range(requests))
    ttfts, tokens = [], 0

    async def client(http):
        nonlocal tokens
        for i in todo:
            ttft, n = await one_request(http, url, model, f"client request {i}: tell me about sharding", max_tokens)
            ttfts.append(ttft)
            tokens += n

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": requests, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3}


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def table(rows: list[dict]) -> str:
    out = [f"{'clients':>7} {'requests':>8} {'tokens':>7} {'wall s':>7} {'tokens/s':>9} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}"]
    for r in rows:
        out.append(f"{r['clients']:>7} {r['requests']:>8} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['tokens_per_s']:>9.1f} {r['ttft_p50_ms']:>11.1f} {r['ttft_p99_ms']:>11.1f}")
    return "\n".join(out)


def targets(rows: list[dict]) -> list[dict]:
    by = {r["clients"]: r for r in rows}
    if 1 not in by or 8 not in by:
        return []
    speedup = by[8]["tokens_per_s"] / by[1]["tokens_per_s"]
    ttft = by[8]["ttft_p99_ms"] / by[1]["ttft_p50_ms"]
    return [
        {"target": "8 clients: aggregate tokens/s >= 4x 1 client", "measured": f"{speedup:.2f}x", "met": speedup >= 4},
        {"target": "8 clients: TTFT p99 <= 3x 1 client's TTFT p50", "measured": f"{ttft:.2f}x", "met": ttft <= 3},
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="a compiled export directory with a tokenizer (export with --batch-sizes 1,8)")
    ap.add_argument("--clients", default="1,4,8", help="comma-separated concurrent client counts (default 1,4,8)")
    ap.add_argument("--requests", type=int, default=16, help="completed requests per client count (default 16)")
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=32, help="tokens per request (default 32)")
    ap.add_argument("--json", help="also write the rows and targets to this file")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    with served(args.artifact) as url:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(level(url, model, 1, 1, args.max_tokens))  # warm-up
        rows = [asyncio.run(level(url, model, c, max(args.requests, c), args.max_tokens)) for c in counts]
    print(table(rows))
    checks = targets(rows)
    for t in checks:
        print(f"{t['target']}: {t['measured']} -> {'met' if t['met'] else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "targets": checks}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
