"""The paged KV cache against the contiguous one (not a test; the benchmark rows of issue 30).

    python tools/bench_paged.py [--model ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--work DIR] [--rounds 3]
        [--sections prefix,capacity,decode,gaps] [--chunks off,256,64]

Exports into ``--work`` (default ``~/.cache/sharktank/bench_paged``; an export there is reused
while the checkout's commit is the one that made it): ``--model`` with batch sizes 1 and 8, a 2048-position cache and pages
of 16, and toy-llama with batch sizes 8 and 64, its 128-position cache and pages of 8 (both
with the contiguous kinds ``prefill,decode,prefill_row,prefill_rows`` only). Then:

1. **Shared prefix**: a 1024-token system prompt seen once (a warm-up request), then 8 requests
   sharing it with different 16-token questions submitted at once: time to first token, p50
   and p99, with the contiguous cache prefilling whole prompts (``paged=False,
   chunk_tokens=None``) against the paged cache with prefix caching, rounds interleaved
   (median and range of the p50s); the greedy answers of both must be equal.
2. **Capacity**: toy-llama, 64 requests of 8 tokens (a 6-token prompt and 2 generated) in the
   KV memory of 8 rows of 128 positions (each request 1/16 of a row, as 256 tokens are of a
   4096-position row): the contiguous cache runs 8 at a time, the paged one (128 pages of 8, the
   same memory) up to 64: the most running at once and the wall time of all 64.
3. **Decode step**: the real model's batch-8 decode at position 1000 of every row, the
   contiguous ``decode_bs8`` against ``decode_paged_bs8`` (its attention reading each row's 63
   pages through the table), 20 steps a round, rounds interleaved (median and range of the
   per-round medians).
4. **Gaps** (chunked prefill): 7 streams decoding in a batch-8 engine while a 1900-token prompt
   is admitted: the longest inter-token gap of the streams during its prefill over their median
   gap before it, with the contiguous cache prefilling the whole prompt in one call against the
   paged cache with prefill chunks of 256 (serve's default) and 64 tokens (``--chunks``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 600
# local-task's poller thread segfaulted here in the contiguous engine's 8-prompt prefill of the
# 1024-token system prompt (IREE 3.10, 2 of 2 runs); local-sync runs every call on the caller.
DRIVER = "local-sync"


def export(work: Path, name: str, *args: str) -> Path:
    """``sharktank export ARGS`` into ``work/name``, again whenever the checkout's commit is
    another than the one that exported it (a stale artifact would time old code)."""
    out = work / name
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    made = out / "bench_commit.txt"
    if not (out / "manifest.json").exists() or not made.exists() or made.read_text() != commit:
        print(f"exporting {name} at {commit[:7] or 'an unknown commit'} (minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "sharktank.cli", "export", *args, "--output-dir", str(out)], check=True, cwd=ROOT)
        made.write_text(commit)
    return out


def submit_all(engine, prompts, max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Submit every prompt at once: (seconds to each one's first token, each one's ids)."""
    from sharktank.text.sampling import SamplingParams

    firsts, ids, done = [None] * len(prompts), [[] for _ in prompts], [threading.Event() for _ in prompts]
    reasons = [None] * len(prompts)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        def on(e, i=i):
            if firsts[i] is None:
                firsts[i] = time.perf_counter() - t0
            if e.token is not None:
                ids[i].append(e.token)
            if e.finish_reason is not None:
                reasons[i] = e.finish_reason
                done[i].set()

        engine.submit(p, SamplingParams(max_tokens=max_tokens), on)
    for d in done:
        if not d.wait(WAIT_S):
            raise RuntimeError(f"a request did not finish within {WAIT_S} s")
    if any(r != "length" for r in reasons):
        raise RuntimeError(f"requests ended {sorted(set(map(str, reasons)))}, not all 'length'")
    return firsts, ids


def pct(values, q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def shared_prefix(art: Path, rounds: int) -> None:
    from sharktank.runtime import CompiledModel
    from sharktank.serving.engine import Engine

    model = CompiledModel(art, driver=DRIVER)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, model.vocab_size, (1024,), generator=g).tolist()
    questions = [torch.randint(0, model.vocab_size, (16,), generator=g).tolist() for _ in range(9)]
    modes = {"contiguous, whole prompts": dict(paged=False, chunk_tokens=None), "paged, prefix caching": dict(paged=True)}
    p50s: dict[str, list[float]] = {m: [] for m in modes}
    p99s: dict[str, list[float]] = {m: [] for m in modes}
    answers: dict[str, list] = {}
    for _ in range(rounds):
        for mode, kw in modes.items():
            engine = Engine(model, batch_size=8, **kw)
            engine.start()
            try:
                submit_all(engine, [system + questions[0]], 1)  # the system prompt seen once
                firsts, ids = submit_all(engine, [system + q for q in questions[1:]], 4)
            finally:
                engine.stop()
            p50s[mode].append(pct(firsts, 0.5))
            p99s[mode].append(pct(firsts, 0.99))
            answers[mode] = ids
    print("\n1. 8 requests at once sharing a 1024-token system prompt (seen once before), 16-token questions:")
    for mode in modes:
        v = p50s[mode]
        print(f"   {mode:28s} TTFT p50 {statistics.median(v) * 1e3:7.0f} ms (rounds {min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}), p99 {statistics.median(p99s[mode]) * 1e3:7.0f} ms")
    a, b = (statistics.median(p50s[m]) for m in modes)
    same = answers[list(modes)[0]] == answers[list(modes)[1]]
    print(f"   p50 ratio {a / b:.1f}x; greedy answers equal: {same}")


def gaps(art: Path, rounds: int, long_tokens: int = 1900, chunks: tuple = (None, 256, 64)) -> None:
    """Section 4: 7 streams decoding while a ``long_tokens`` prompt is admitted: the longest
    inter-token gap of the streams while it prefills (from its submit to its first token)
    over their median gap, per prefill chunk budget (None: the contiguous cache, whole prompts)."""
    from sharktank.runtime import CompiledModel
    from sharktank.serving.engine import Engine
    from sharktank.text.sampling import SamplingParams

    model = CompiledModel(art, driver=DRIVER)
    g = torch.Generator().manual_seed(1)
    streams = [torch.randint(0, model.vocab_size, (16,), generator=g).tolist() for _ in range(7)]
    long_prompt = torch.randint(0, model.vocab_size, (long_tokens,), generator=g).tolist()
    results: dict = {c: [] for c in chunks}
    for _ in range(rounds):
        for chunk in chunks:
            kw = dict(paged=False, chunk_tokens=None) if chunk is None else dict(paged=True, chunk_tokens=chunk)
            engine = Engine(model, batch_size=8, **kw)
            engine.start()
            stamps = [[] for _ in streams]
            done = [threading.Event() for _ in streams]
            long_first, long_done = [None], threading.Event()
            try:
                for i, p in enumerate(streams):
                    def on(e, i=i):
                        if e.token is not None:
                            stamps[i].append(time.perf_counter())
                        if e.finish_reason is not None:
                            done[i].set()
                    engine.submit(p, SamplingParams(max_tokens=120), on)
                deadline = time.monotonic() + WAIT_S
                while min(len(s) for s in stamps) < 20 and time.monotonic() < deadline:  # all 7 decoding
                    time.sleep(0.01)
                t_submit = time.perf_counter()

                def on_long(e):
                    if long_first[0] is None and e.token is not None:
                        long_first[0] = time.perf_counter()
                    if e.finish_reason is not None:
                        long_done.set()
                engine.submit(long_prompt, SamplingParams(max_tokens=1), on_long)
                for d in (*done, long_done):
                    if not d.wait(WAIT_S):
                        raise RuntimeError(f"a request did not finish within {WAIT_S} s")
            finally:
                engine.stop()
            t_first = long_first[0]
            before = [b - a for s in stamps for a, b in zip(s, s[1:]) if b < t_submit]
            during = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > t_submit and a < t_first]
            results[chunk].append((max(during) if during else float("nan"), statistics.median(before), t_first - t_submit))
    print(f"\n4. 7 streams decoding while a {long_tokens}-token prompt is admitted (batch 8, {rounds} rounds, median):")
    for chunk in chunks:
        rows = results[chunk]
        worst, med, ttft = (statistics.median(r[k] for r in rows) for k in range(3))
        name = "contiguous, whole prompt" if chunk is None else f"paged, chunks of {chunk}"
        ratios = [r[0] / r[1] for r in rows]
        print(f"   {name:26s} longest gap {worst * 1e3:7.0f} ms, median gap {med * 1e3:5.0f} ms: {statistics.median(ratios):5.1f}x "
              f"(rounds {min(ratios):.1f}-{max(ratios):.1f}); the long prompt's first token after {ttft:.1f} s")


def capacity(art: Path) -> None:
    from sharktank.runtime import CompiledModel
    from sharktank.serving.engine import Engine

    model = CompiledModel(art, driver=DRIVER)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.vocab_size, (6,), generator=g).tolist() for _ in range(64)]
    print("\n2. toy-llama, 64 requests of 6 prompt + 2 generated tokens, KV memory of 8 rows x 128 positions:")
    results = {}
    for mode, kw in (("contiguous, batch 8", dict(batch_size=8, paged=False)), ("paged, batch 64", dict(batch_size=64, paged=True, kv_pages=8 * 128 // 8))):
        engine = Engine(model, **kw)
        most, stop = [0], threading.Event()

        def watch():
            while not stop.is_set():
                most[0] = max(most[0], engine.stats().running)
                time.sleep(0.002)

        engine.start()
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        try:
            t0 = time.perf_counter()
            _, ids = submit_all(engine, prompts, 2)
            wall = time.perf_counter() - t0
        finally:
            stop.set()
            engine.stop()
        results[mode] = ids
        print(f"   {mode:22s} most running at once {most[0]:3d}, all 64 in {wall * 1e3:6.0f} ms ({64 * 2 / wall:6.0f} tokens/s)")
    a, b = results.values()
    print(f"   greedy answers equal: {a == b}")


def decode_step(art: Path, rounds: int) -> None:
    from sharktank.runtime import CompiledModel

    model = CompiledModel(art, driver=DRIVER)
    cache = model.new_cache(8)
    pool = model.new_pool(8 * model.max_pages + 1)
    tables = [list(range(1 + r * model.max_pages, 1 + (r + 1) * model.max_pages)) for r in range(8)]
    tokens, positions = [1] * 8, [1000] * 8
    times: dict[str, list[float]] = {"contiguous decode_bs8": [], "paged decode_paged_bs8": []}
    for _ in range(rounds):
        for name in times:
            steps = []
            for _ in range(20):
                t0 = time.perf_counter()
                if name.startswith("paged"):
                    _, pool = model.decode_paged(tokens, positions, tables, pool)
                else:
                    _, cache = model.decode(torch.tensor(tokens), cache, torch.tensor(positions))
                steps.append(time.perf_counter() - t0)
            times[name].append(statistics.median(steps))
    print("\n3. batch-8 decode step at position 1000 (a 2048-position cache):")
    for name, v in times.items():
        print(f"   {name:24s} {statistics.median(v) * 1e3:6.2f} ms (rounds {min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})")
    a, b = (statistics.median(v) for v in times.values())
    print(f"   paged / contiguous: {b / a:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "sharktank" / "bench_paged"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sections", default="prefix,capacity,decode,gaps", help="comma-separated sections to run (default prefix,capacity,decode,gaps)")
    ap.add_argument("--chunks", default="off,256,64", help="section 4's prefill chunk budgets, comma-separated: off (the contiguous cache, "
                    "whole prompts) or tokens per step over the paged cache (default off,256,64)")
    args = ap.parse_args()
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    if not sections or sections - {"prefix", "capacity", "decode", "gaps"}:
        ap.error(f"--sections takes some of prefix, capacity, decode, gaps; found {args.sections!r}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    # The contiguous kinds the sections run (whole prompts: prefill_row and prefill_rows; no chunks).
    kinds = ("--functions", "prefill,decode,prefill_row,prefill_rows")
    if sections & {"prefix", "decode", "gaps"}:
        real = export(work, "model-bs1-8-T2048-page16-rows", "--model", args.model, "--batch-sizes", "1,8", "--max-seq-len", "2048", "--page-size", "16", *kinds)
    if "prefix" in sections:
        shared_prefix(real, args.rounds)
    if "capacity" in sections:
        capacity(export(work, "toy-bs8-64-T128-page8-rows", "--model", "toy-llama", "--batch-sizes", "8,64", "--page-size", "8", *kinds))
    if "decode" in sections:
        decode_step(real, args.rounds)
    if "gaps" in sections:
        try:
            chunks = tuple(None if c.strip() == "off" else int(c) for c in args.chunks.split(","))
        except ValueError:
            ap.error(f"--chunks takes off or token counts, comma-separated; found {args.chunks!r}")
        gaps(real, args.rounds, chunks=chunks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
