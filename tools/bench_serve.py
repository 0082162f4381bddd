"""Serving throughput, latency and the scheduler's overhead: `sharktank serve` under streaming clients.

    python tools/bench_serve.py ARTIFACT_DIR [--clients 1,4,8] [--requests 16] [--max-tokens 32]
        [--burst 8] [--prompt-tokens 128] [--rounds 3] [--serve-option=--prefill-chunk=off ...]
        [--llamacpp FILE.gguf] [--json FILE]

Starts ``sharktank serve ARTIFACT_DIR`` on 127.0.0.1 (a free port) in a subprocess, sends one
warm-up request, then:

1. **Levels**: for each client count, that many streaming greedy completions in flight until
   ``--requests`` have finished: generated tokens (the usage chunk's ``completion_tokens``) over
   the level's wall time, and the time to first token of each request (from sending it to the
   first chunk carrying a token), p50 and p99. Target (issue 30): 8 clients reach >= 4x the
   aggregate tokens/s of 1 client.
2. **Burst** (the scheduler's overhead): ``--burst`` requests of ``--prompt-tokens`` random token
   ids each, sent at once, their TTFT p99; against, in this process, the same artifact's
   ``CompiledModel`` running those prompts' ``prefill_bs1`` back to back plus one decode step of
   the server's batch (``decode_bs{B}``): the least a scheduler can take to give every prompt
   its first token. The two sides alternate in ``--rounds`` rounds (median and range; this
   machine is shared, so only a ratio within one run means anything). Target (issue 30): TTFT
   p99 <= 1.25x that sum.

3. **llama.cpp's server** (``--llamacpp FILE.gguf``, the GGUF the artifact was exported from):
   ``python -m llama_cpp.server`` of llama-cpp-python (built as ``tools/bench_llamacpp.py``
   says, into ``~/.cache/sharktank/llamacpp``, with its server's packages beside it), 2 threads,
   on 127.0.0.1 after ours has stopped, under the same levels. Its 0.3.36 server has no
   parallel slots (it computes one request at a time), so its rows show what a user of it gets;
   its tokens are counted as the streamed chunks carrying text.

Every request and the server's start are bounded by timeouts; the server is stopped on exit,
also on failure. The artifact should export the burst's batch size (``--batch-sizes 1,8``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
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
    with served_process(artifact, *options, start_timeout=start_timeout) as (url, _):
        yield url


def _stop(p: subprocess.Popen) -> None:
    """Terminate ``p``, killed if it has not exited within 15 s."""
    p.terminate()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


@contextmanager
def served_process(artifact: str, *options: str, start_timeout: float = 180):
    """``(base URL, process)`` of :func:`served`'s server."""
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
        yield next(line for line in lines if " at http://" in line).split(" at ")[1].split("/v1")[0], p
    finally:
        _stop(p)


LLAMACPP = Path.home() / ".cache" / "sharktank" / "llamacpp"


@contextmanager
def llamacpp_served(gguf: str, ctx: int, start_timeout: float = 180):
    """The base URL of llama-cpp-python's server of ``gguf`` on 127.0.0.1 (a free port), ready
    when ``/v1/models`` answers; stopped on exit."""
    import os
    import socket

    if not (LLAMACPP / "llama_cpp" / "server").is_dir():
        raise SystemExit(f"llama-cpp-python's server is not in {LLAMACPP} (see tools/bench_llamacpp.py, then pip install "
                         "--target it sse-starlette starlette-context pydantic-settings python-dotenv)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(LLAMACPP))
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(ctx), "--n_threads", "2", "--n_threads_batch", "2",
           "--interrupt_requests", "False"]  # by default a new request cancels the one streaming
    log = tempfile.TemporaryFile("w+")  # llama.cpp logs much to stderr: a pipe nobody read would block it
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if p.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"llama.cpp's server did not become ready (exit {p.poll()}): {log.read()[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        _stop(p)
        log.close()


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str | list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, completion tokens) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    first, tokens, chunks = None, None, 0
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
            elif chunk.get("choices") and (chunk["choices"][0].get("token_ids") or chunk["choices"][0].get("text")):
                first = time.perf_counter() - t0 if first is None else first
                chunks += 1
    return first, tokens if tokens is not None else chunks  # a server without usage chunks: one token a chunk


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
    return [{"target": "8 clients: aggregate tokens/s >= 4x 1 client", "measured": f"{speedup:.2f}x", "met": speedup >= 4}]


async def burst_ttfts(url: str, model: str, prompts: list[list[int]]) -> list[float]:
    """Each prompt's TTFT, all sent at once (one connection each)."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=len(prompts))) as http:
        got = await asyncio.gather(*(one_request(http, url, model, p, 2) for p in prompts))
    return [ttft for ttft, _ in got]


def back_to_back(compiled, prompts: list[list[int]], batch: int) -> float:
    """Seconds of the prompts' prefill_bs1 calls one after another plus one decode step of
    ``batch`` rows (every row at the longest prompt's position)."""
    import torch

    cache = compiled.new_cache(batch)
    t0 = time.perf_counter()
    for p in prompts:
        compiled.prefill(torch.tensor([p]), logits="last")  # as the engine calls it
    compiled.decode(torch.zeros(batch, dtype=torch.int64), cache, torch.full((batch,), max(map(len, prompts)), dtype=torch.int64))
    return time.perf_counter() - t0


def burst(url: str, model: str, artifact: str, n: int, length: int, rounds: int, seed: int = 0) -> dict:
    """The burst section: TTFT p99 of ``n`` simultaneous prompts against their back-to-back
    prefills plus one decode step, in alternating rounds (new prompts each round, the same on
    both sides)."""
    import random

    from sharktank.runtime import CompiledModel

    compiled = CompiledModel(artifact)
    batch = max(b for b in compiled.manifest.batch_sizes if compiled.find("decode", b))
    if length + 2 > compiled.find("decode", batch).max_seq_len:
        raise SystemExit(f"--prompt-tokens {length}: the cache holds {compiled.find('decode', batch).max_seq_len} positions")
    rng = random.Random(seed)
    vocab = compiled.vocab_size
    back_to_back(compiled, [[1] * length], batch)  # warm-up of the functions timed
    served_p99, alone = [], []
    for _ in range(rounds):
        prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
        served_p99.append(percentile(asyncio.run(burst_ttfts(url, model, prompts)), 99))
        alone.append(back_to_back(compiled, prompts, batch))
    ratios = [a / b for a, b in zip(served_p99, alone)]
    return {"requests": n, "prompt_tokens": length, "rounds": rounds, "decode_batch": batch,
            "ttft_p99_ms": [t * 1e3 for t in served_p99], "back_to_back_ms": [t * 1e3 for t in alone], "ratio": ratios}


def burst_table(b: dict) -> str:
    def med(xs):
        return f"{percentile(xs, 50):.1f} ({min(xs):.1f}-{max(xs):.1f})"

    return "\n".join([
        f"burst: {b['requests']} requests of {b['prompt_tokens']} tokens at once, {b['rounds']} rounds (median, range)",
        f"  served TTFT p99 ms:                         {med(b['ttft_p99_ms'])}",
        f"  prefill_bs1 x {b['requests']} + decode_bs{b['decode_batch']} back to back ms: {med(b['back_to_back_ms'])}",
        f"  ratio:                                      {percentile(b['ratio'], 50):.2f}x ({min(b['ratio']):.2f}-{max(b['ratio']):.2f})",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="a compiled export directory with a tokenizer (export with --batch-sizes 1,8)")
    ap.add_argument("--clients", default="1,4,8", help="comma-separated concurrent client counts (default 1,4,8; empty: none)")
    ap.add_argument("--requests", type=int, default=16, help="completed requests per client count (default 16)")
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=32, help="tokens per request (default 32)")
    ap.add_argument("--burst", type=int, default=8, help="requests sent at once in the burst section (default 8; 0: skip it)")
    ap.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=128, help="tokens per burst prompt (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="burst rounds, alternating with the back-to-back side (default 3)")
    ap.add_argument("--serve-option", dest="serve_options", action="append", default=[], help="an option for `sharktank serve` (repeatable), e.g. --serve-option=--prefill-chunk=off")
    ap.add_argument("--llamacpp", metavar="GGUF", help="also run the levels against llama-cpp-python's server of this GGUF file (section 3)")
    ap.add_argument("--json", help="also write the rows and targets to this file")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",") if c.strip()]
    rows, bursts = [], None
    with served(args.artifact, *args.serve_options) as url:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for c in counts or [1]:  # warm-up: every client count once (each decode batch function runs before timing)
            asyncio.run(level(url, model, c, c, args.max_tokens))
        rows = [asyncio.run(level(url, model, c, max(args.requests, c), args.max_tokens)) for c in counts]
        if args.burst:
            bursts = burst(url, model, args.artifact, args.burst, args.prompt_tokens, args.rounds)
    theirs = []
    if args.llamacpp:
        from sharktank.runtime.compiled import read_manifest

        ctx = min(f.max_seq_len for f in read_manifest(args.artifact).functions.values())
        with llamacpp_served(args.llamacpp, ctx) as url:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            asyncio.run(level(url, model, 1, 1, args.max_tokens))  # warm-up
            theirs = [asyncio.run(level(url, model, c, max(args.requests, c), args.max_tokens)) for c in counts]
    checks = targets(rows)
    if rows:
        print(table(rows))
    if theirs:
        print("llama.cpp's server (llama-cpp-python, one request at a time):")
        print(table(theirs))
        print("ours / llama.cpp, tokens/s: " + ", ".join(f"{a['clients']} clients {a['tokens_per_s'] / b['tokens_per_s']:.2f}x" for a, b in zip(rows, theirs)))
    if bursts:
        print(burst_table(bursts))
        r = percentile(bursts["ratio"], 50)
        checks.append({"target": f"{bursts['requests']} simultaneous requests: TTFT p99 <= 1.25x their prefills back to back + one decode step",
                       "measured": f"{r:.2f}x", "met": r <= 1.25})
    for t in checks:
        print(f"{t['target']}: {t['measured']} -> {'met' if t['met'] else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "burst": bursts, "targets": checks, "llamacpp_rows": theirs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
