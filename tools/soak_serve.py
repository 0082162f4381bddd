"""The serving soak: `sharktank serve` over a small KV-cache pool under a random mixed load, over HTTP.

    python tools/soak_serve.py ARTIFACT_DIR [--requests 200] [--concurrency 8] [--kv-pages 24]
        [--max-tokens 8] [--max-prompt N] [--seed 0] [--json FILE]

Starts ``sharktank serve ARTIFACT_DIR`` on 127.0.0.1 (an artifact exported with ``--page-size``)
with a pool of ``--kv-pages`` pages (given to the server as ``--kv-cache-gib``), small enough
that cached prefix pages are evicted all the time and running requests are preempted (their
pages freed for older ones, their tokens recomputed when resumed). Then:

1. **Alone**: every distinct completion the load will need is asked once, one request at a
   time (greedy): what each request must answer.
2. **Load**: ``--requests`` requests, ``--concurrency`` in flight. Prompts are random token ids,
   most cut from three shared stems (shared prefixes of any length), the rest unshared; each
   request is one of: streamed to its end, non-streamed, streamed and then **disconnected**
   after 0-2 tokens (the client closes the connection), or given up on before any answer (a
   client timeout of a few milliseconds: a disconnect while it waits or prefills). Meanwhile
   ``/health`` is asked every 0.2 s (each answer within 5 s) and the server's RSS
   (``/proc/PID/status``) is sampled.
3. **After**: ``/metrics`` must show no running request and no page held (``kv_pages_used``
   0) within 10 s: a leaked page would stay held.

Checked: every request that ran to its end equals its alone answer token for token (a 429 when
the queue is full is allowed, a wrong or failed answer is not); the health checks all answered;
RSS after the load against after the alone phase. Exit status 1 when a check fails.
``tests/serving/test_soak_serve.py`` runs a CI-sized load of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import served_process  # noqa: E402

HEALTH_EVERY_S = 0.2
HEALTH_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 120.0
MODES = ("stream", "plain", "disconnect", "give_up")


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int
    mode: str  # one of MODES
    after: int = 0  # disconnect: tokens read before closing


def plan(n: int, seed: int, vocab: int, max_prompt: int, max_tokens: int) -> list[Job]:
    """``n`` jobs: 70 % of prompts a prefix of one of three shared stems plus a few tokens of
    their own, the rest unshared; modes 40 % stream, 20 % plain, 25 % disconnect, 15 % give up."""
    rng = random.Random(seed)
    stem_len = max(1, max_prompt - 6)
    stems = [[rng.randrange(vocab) for _ in range(stem_len)] for _ in range(3)]
    jobs = []
    for _ in range(n):
        stem = stems[rng.randrange(3)] if rng.random() < 0.7 else []
        prompt = stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        mode = rng.choices(MODES, weights=(40, 20, 25, 15))[0]
        jobs.append(Job(tuple(prompt[:max_prompt]), rng.randrange(1, max_tokens + 1), mode, rng.randrange(3)))
    return jobs


def _body(model: str, job: Job, stream: bool) -> dict:
    body = {"model": model, "prompt": list(job.prompt), "max_tokens": job.max_tokens, "temperature": 0, "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def ask(http: httpx.AsyncClient, url: str, model: str, job: Job) -> tuple[str, list[int] | None]:
    """``(outcome, ids)``: ``done`` with the answer's ids (streamed or not), ``refused`` (429),
    ``disconnected`` or ``gave_up`` (no ids), ``failed: ...`` for anything else."""
    if job.mode == "give_up":
        try:
            await http.post(url + "/v1/completions", json=_body(model, job, False), timeout=0.003)
        except httpx.TimeoutException:
            return "gave_up", None
        return "done_early", None  # answered within 3 ms: not a disconnect, not compared
    if job.mode == "plain":
        r = await http.post(url + "/v1/completions", json=_body(model, job, False))
        if r.status_code == 429:
            return "refused", None
        if r.status_code != 200:
            return f"failed: HTTP {r.status_code} {r.text[:200]}", None
        return "done", r.json()["choices"][0]["token_ids"]
    ids: list[int] = []
    async with http.stream("POST", url + "/v1/completions", json=_body(model, job, True)) as r:
        if r.status_code == 429:
            return "refused", None
        if r.status_code != 200:
            return f"failed: HTTP {r.status_code} {(await r.aread()).decode()[:200]}", None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"failed: {chunk['error']}", None
            if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                ids.extend(chunk["choices"][0]["token_ids"])
                if job.mode == "disconnect" and len(ids) > job.after:
                    return "disconnected", None  # leaving the block closes the connection
    if job.mode == "disconnect":
        return "done_early", None  # ended before the client meant to leave
    return "done", ids


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=HEALTH_TIMEOUT_S).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def load(url: str, model: str, jobs: list[Job], concurrency: int, pid: int) -> dict:
    """The load phase: outcomes per job, health-check failures, RSS samples."""
    outcomes: list[tuple[str, list[int] | None]] = [("", None)] * len(jobs)
    health_failures: list[str] = []
    rss: list[int] = []
    todo = iter(range(len(jobs)))
    finished = asyncio.Event()

    async def client(http):
        for i in todo:
            try:
                outcomes[i] = await ask(http, url, model, jobs[i])
            except httpx.HTTPError as e:
                outcomes[i] = (f"failed: {type(e).__name__}: {e}", None)

    async def watch(http):
        while not finished.is_set():
            try:
                r = await http.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
                if r.status_code != 200:
                    health_failures.append(f"HTTP {r.status_code}")
            except httpx.HTTPError as e:
                health_failures.append(f"{type(e).__name__}")
            kib = rss_kib(pid)
            if kib is not None:
                rss.append(kib)
            try:
                await asyncio.wait_for(finished.wait(), HEALTH_EVERY_S)
            except asyncio.TimeoutError:
                pass

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=concurrency + 2)) as http:
        t0 = time.perf_counter()
        watcher = asyncio.create_task(watch(http))
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        finished.set()
        await watcher
        wall = time.perf_counter() - t0
    return {"outcomes": outcomes, "health_failures": health_failures, "rss_kib": rss, "wall_s": wall}


async def alone(url: str, model: str, jobs: list[Job]) -> dict[tuple, list[int]]:
    """The answer of each distinct (prompt, max_tokens) the load will compare, one at a time."""
    want: dict[tuple, list[int]] = {}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        for job in jobs:
            key = (job.prompt, job.max_tokens)
            if job.mode in ("stream", "plain") and key not in want:
                outcome, ids = await ask(http, url, model, Job(job.prompt, job.max_tokens, "plain"))
                if outcome != "done":
                    raise SystemExit(f"the alone request for a prompt of {len(job.prompt)} tokens did not answer: {outcome}")
                want[key] = ids
    return want


def run(artifact: str, *, requests: int, concurrency: int, kv_pages: int, seed: int = 0, max_prompt: int | None = None,
        max_tokens: int = 8, start_timeout: float = 180) -> dict:
    """The whole soak against a server of ``artifact``; returns the report (``report["ok"]``)."""
    from sharktank.runtime import CompiledModel

    compiled = CompiledModel(artifact)  # for the page size in bytes and the vocabulary
    if compiled.page_size is None:
        raise SystemExit(f"{artifact}: no paged functions (export with --page-size)")
    page_bytes = max(compiled.page_bytes().values())
    max_prompt = max_prompt or max(2, compiled.find("decode", max(compiled.manifest.batch_sizes)).max_seq_len // 2)
    vocab = compiled.vocab_size
    del compiled
    gib = (kv_pages + 0.5) * page_bytes / 2**30  # pages_in floors: half a page more gives exactly kv_pages
    jobs = plan(requests, seed, vocab, max_prompt, max_tokens)
    with served_process(artifact, "--kv-cache-gib", repr(gib), "--max-queue", str(4 * concurrency), start_timeout=start_timeout) as (url, proc):
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        pool = metrics(url).get("sharktank_kv_pages")
        want = asyncio.run(alone(url, model, jobs))
        rss_before = rss_kib(proc.pid)
        got = asyncio.run(load(url, model, jobs, concurrency, proc.pid))
        deadline, after = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            after = metrics(url)
            if after.get("sharktank_rows_running", 1) == 0 and after.get("sharktank_kv_pages_used", 1) == 0:
                break
            time.sleep(0.1)
        rss_after = rss_kib(proc.pid)
    counts: dict[str, int] = {}
    wrong = []
    for job, (outcome, ids) in zip(jobs, got["outcomes"]):
        kind = outcome.split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
        if outcome == "done" and ids != want[(job.prompt, job.max_tokens)]:
            wrong.append({"prompt_tokens": len(job.prompt), "max_tokens": job.max_tokens, "mode": job.mode, "got": ids, "want": want[(job.prompt, job.max_tokens)]})
    failed = [o for o, _ in got["outcomes"] if o.startswith("failed")]
    report = {
        "requests": requests, "concurrency": concurrency, "kv_pages": pool, "outcomes": counts, "wrong": wrong, "failed": failed[:5],
        "health_checks": len(got["rss_kib"]), "health_failures": got["health_failures"], "wall_s": got["wall_s"],
        "kv_pages_used_after": after.get("sharktank_kv_pages_used"), "rows_running_after": after.get("sharktank_rows_running"),
        "kv_pages_cached_after": after.get("sharktank_kv_pages_cached"), "prefix_cache_hit_tokens": after.get("sharktank_prefix_cache_hit_tokens"),
        "preemptions": after.get("sharktank_preemptions"),
        "rss_kib": {"after_alone": rss_before, "after_load": rss_after, "peak_during_load": max(got["rss_kib"], default=None)},
    }
    report["ok"] = not wrong and not failed and not got["health_failures"] and report["kv_pages_used_after"] == 0 and report["rows_running_after"] == 0
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="a compiled export directory with the paged functions (export --page-size) and a tokenizer")
    ap.add_argument("--requests", type=int, default=200, help="requests in the load (default 200)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    ap.add_argument("--kv-pages", dest="kv_pages", type=int, default=24, help="pages in the server's pool (default 24)")
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=8, help="the most tokens a request asks for (default 8)")
    ap.add_argument("--max-prompt", dest="max_prompt", type=int, help="the longest prompt in tokens (default half the cache length)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the load's prompts and modes (default 0)")
    ap.add_argument("--json", help="also write the report to this file")
    args = ap.parse_args(argv)
    report = run(args.artifact, requests=args.requests, concurrency=args.concurrency, kv_pages=args.kv_pages, seed=args.seed, max_tokens=args.max_tokens,
                 max_prompt=args.max_prompt)
    rss = report["rss_kib"]
    print(f"{report['requests']} requests, {report['concurrency']} in flight, a pool of {report['kv_pages']:.0f} pages, {report['wall_s']:.1f} s")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items())))
    print(f"wrong answers: {len(report['wrong'])}; failed: {len(report['failed'])}; health checks {report['health_checks']}, failed {len(report['health_failures'])}")
    print(f"after: rows running {report['rows_running_after']:.0f}, pages held {report['kv_pages_used_after']:.0f}, cached {report['kv_pages_cached_after']:.0f}; "
          f"prefix-cache hit tokens {report['prefix_cache_hit_tokens']:.0f}, preemptions {report['preemptions'] or 0:.0f}")
    print(f"server RSS: {rss['after_alone']} KiB after the alone phase, {rss['after_load']} KiB after the load (peak {rss['peak_during_load']} KiB)")
    print("OK" if report["ok"] else "FAILED")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
