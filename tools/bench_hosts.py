"""Multi-host pipeline on loopback against the one-host artifact with the same stages.

Exports toy-llama (tp2 x pp2) as one program and split over 2 hosts (or reuses them under
--artifacts), then, in interleaved rounds, runs the one-host artifact and the 2 ranks (gloo on
127.0.0.1) and prints per decode token: the bytes each rank sent (counted by the runtime)
next to hidden size x dtype bytes x batch per boundary, and the time (median and range of
each round's median).

    python tools/bench_hosts.py [--rounds 5] [--new-tokens 32] [--artifacts DIR] [--model toy-llama]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "sharktank.cli", *map(str, args)]


def export(model: str, out: Path, hosts: int) -> None:
    if (out / "manifest.json").exists():
        return
    subprocess.run(cli("export", "--model", model, "--tp", 2, "--pp", 2, "--hosts", hosts, "--max-seq-len", 128, "--output-dir", out), cwd=ROOT, check=True, capture_output=True, timeout=900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_hosts(directory: Path, hosts: int, prompt: list[str]) -> dict:
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": str(hosts), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen(cli("run", directory, *prompt, "--json"), cwd=ROOT, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(hosts)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"distributed run failed: {[o[1][-500:] for o in outs]}")
    return json.loads(outs[0][0])


def run_single(directory: Path, prompt: list[str]) -> dict:
    p = subprocess.run(cli("run", directory, *prompt, "--json"), cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(p.stdout)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", default="toy-llama")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "out" / "bench_hosts")
    args = ap.parse_args()
    single, split = args.artifacts / f"{args.model}-tp2pp2", args.artifacts / f"{args.model}-tp2pp2-2hosts"
    export(args.model, single, 1)
    export(args.model, split, 2)
    m = json.loads((split / "manifest.json").read_text())
    prompt = ["--tokens", "1,2,3,4,5,6,7,8", "--max-new-tokens", str(args.new_tokens)]
    times: dict[str, list[float]] = {"one host": [], "2 hosts": []}
    sent = None
    for _ in range(args.rounds):  # interleaved: both see the same machine load
        times["one host"].append(run_single(single, prompt)["decode_ms_per_token"]["median"])
        r = run_hosts(split, 2, prompt)
        times["2 hosts"].append(r["decode_ms_per_token"]["median"])
        sent = r["bytes_per_decode_token"]
    b = m["boundary"]
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[b["dtype"]]
    batch, boundaries = 1, len(m["hosts"]) - 1
    vocab = m["model"]["config"]["vocab_size"]
    print(f"{args.model} tp2 x pp2, batch {batch}, {args.new_tokens} new tokens, {args.rounds} interleaved rounds, gloo on 127.0.0.1")
    print(f"{'row':54} {'measured':>22} {'reference':>30}")
    hidden = b["hidden_size"] * dtype_bytes * batch
    for rank, n in sorted(sent.items(), key=lambda x: int(x[0])):
        last = int(rank) == len(m["hosts"]) - 1
        ref = f"logits {vocab}x{dtype_bytes}x{batch} = {vocab * dtype_bytes * batch}" if last else f"hidden {b['hidden_size']}x{dtype_bytes}x{batch} = {hidden} (+24 header +8 pos)"
        print(f"{'bytes sent per decode token, rank ' + rank:54} {n:>22} {ref:>30}")
    print(f"{'bytes crossing hosts per decode token (all ranks)':54} {sum(sent.values()):>22} {f'{boundaries} boundary x {hidden} + logits':>30}")
    print(f"{'decode ms/token, one host (4 devices)':54} {spread(times['one host']):>22}")
    print(f"{'decode ms/token, 2 hosts x 2 devices (loopback)':54} {spread(times['2 hosts']):>22}")
    ratio = [h / s for h, s in zip(times["2 hosts"], times["one host"])]
    print(f"{'2 hosts / one host, per round':54} {spread(ratio):>22}")


if __name__ == "__main__":
    main()
