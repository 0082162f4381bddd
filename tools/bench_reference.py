"""Harness rows for ``toy-llama-3l`` (see ``tools/bench.py``): the preset with the public
sharktank package's toy Llama shapes, float16, batch 1, an 8-token prompt, next to the
figures that package measured on this machine.

Export and compile run through the command line (``sharktank export --json``), so the wall
time includes starting Python and importing torch, as a user sees it; the in-process
export and compile seconds come from the same run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["PUBLIC", "reference_rows"]

MODEL = "toy-llama-3l"
PROMPT = 8
# The public sharktank package on the same model and machine (from the issue).
PUBLIC = {
    "export_s": 14.3,
    "compile_s": 7.4,
    "prefill_ms": 1.65,
    "decode_ms": 0.50,
    "eager_decode_ms": 16.0,
    "pp2_decode_ms": 0.77,
    "pp2_transfers": 56,
    "pp2_decode_transfers": 26,
}


DRIVERS = {"": "local-task", "_sync": "local-sync"}  # row suffix -> runtime driver


def _build(root: Path, name: str, flags: list[str]) -> dict:
    """Export + compile ``name`` with the CLI (or reuse a loadable artifact)."""
    from sharktank.runtime import ArtifactError, CompiledModel

    directory = root / name
    try:
        CompiledModel(directory)
        m = json.loads((directory / "manifest.json").read_text())
        return {"reused": True, "wall_s": None, "export_s": m["export_seconds"], "compile_s": m["compile"]["seconds"], "transfers": m["transfers"]}
    except ArtifactError:
        pass
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "sharktank.cli", "export", "--model", MODEL, *flags, "--output-dir", str(directory), "--json"],
        check=True, capture_output=True, text=True,
    )
    wall = time.perf_counter() - t0
    s = json.loads(out.stdout)
    return {"reused": False, "wall_s": wall, "export_s": s["export_seconds"], "compile_s": s["compile_seconds"], "transfers": s["transfers"]}


def reference_rows(root: Path, rounds: int, decode_steps: int = 16) -> dict:
    """Build tp1 and pp2 artifacts, time prefill and decode against each other and eager."""
    from sharktank.models import load_model
    from sharktank.runtime import CompiledModel

    builds = {"tp1": _build(root, "t3l-tp1", []), "pp2": _build(root, "t3l-pp2", ["--pp", "2"])}
    # Each artifact on both CPU drivers: local-task (the default, a worker pool) and
    # local-sync (on the calling thread).
    models = {f"{n}{suffix}": CompiledModel(root / f"t3l-{n}", driver=driver) for n in builds for suffix, driver in DRIVERS.items()}
    eager = load_model(MODEL)
    tokens = torch.randint(0, eager.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))

    def decode_run(m):
        def run():
            logits, cache = m.prefill(tokens)
            pos = torch.tensor([PROMPT])
            for _ in range(decode_steps):
                logits, cache = m.decode(logits[:, -1].argmax(-1), cache, pos)
                pos = pos + 1
        return run

    runs = {n: decode_run(m) for n, m in models.items()}
    for n, run in runs.items():
        run()  # warm up
        models[n].timings = {"prefill": [], "decode": []}
    # The compiled modules time themselves (CompiledModel.timings: inputs placed to logits on
    # the host); each round runs every config in turn.
    for _ in range(rounds):
        for run in runs.values():
            run()
    rows: dict = {"model": MODEL, "prompt": PROMPT, "decode_steps": decode_steps, "public": PUBLIC, "builds": builds}
    for n, m in models.items():
        d, p = m.timings["decode"], m.timings["prefill"]
        rows[n] = {
            "prefill_ms": statistics.median(p) * 1e3,
            "decode_ms": statistics.median(d) * 1e3,
            "decode_ms_min": min(d) * 1e3,
            "decode_ms_max": max(d) * 1e3,
        }
    # Eager after the compiled rows: torch's CPU threads would otherwise spin beside IREE's.
    with torch.no_grad():
        cache = eager.new_cache(1, PROMPT + 2 * decode_steps)
        logits = eager.prefill(tokens, cache)
        nxt, pos = logits[:, -1].argmax(-1), torch.tensor([PROMPT])
        steps = []
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            logits = eager.decode(nxt, cache, pos)
            steps.append(time.perf_counter() - t0)
            pos = pos + 1
    rows["eager_decode_ms"] = statistics.median(steps) * 1e3
    tp1 = builds["tp1"]
    rows["export_compile_cli_wall_s"] = tp1["wall_s"]  # None: a reused artifact
    rows["export_compile_in_process_s"] = tp1["export_s"] + tp1["compile_s"]
    return rows


def print_reference(r: dict) -> None:
    pub = r["public"]
    tp1, pp2 = r["builds"]["tp1"], r["builds"]["pp2"]
    print(f"\n== {r['model']} (float16, batch 1, prompt {r['prompt']}) next to the public sharktank package's figures (from another run)")
    print(f"{'row':<34} {'ours':>10} {'public':>10}")
    wall = "reused" if tp1["wall_s"] is None else f"{tp1['wall_s']:.1f}"
    print(f"{'export + compile, CLI wall s':<34} {wall:>10} {pub['export_s'] + pub['compile_s']:>10.1f}")
    print(f"{'  export s (in process)':<34} {tp1['export_s']:>10.1f} {pub['export_s']:>10.1f}")
    print(f"{'  compile s':<34} {tp1['compile_s']:>10.1f} {pub['compile_s']:>10.1f}")
    print("(compiled rows: the local-task driver, IREE's default for CPU, unless marked local-sync)")
    print(f"{'prefill ms (compiled)':<34} {r['tp1']['prefill_ms']:>10.2f} {pub['prefill_ms']:>10.2f}")
    d = r["tp1"]
    print(f"{'decode ms/token (compiled)':<34} {d['decode_ms']:>10.3f} {pub['decode_ms']:>10.2f}   min-max {d['decode_ms_min']:.3f}-{d['decode_ms_max']:.3f}")
    print(f"{'decode ms/token (eager torch)':<34} {r['eager_decode_ms']:>10.2f} {pub['eager_decode_ms']:>10.2f}")
    print(f"{'pp=2 decode ms/token':<34} {r['pp2']['decode_ms']:>10.3f} {pub['pp2_decode_ms']:>10.2f}")
    s, s2 = r["tp1_sync"], r["pp2_sync"]
    print(f"{'  on local-sync: prefill ms':<34} {s['prefill_ms']:>10.2f} {pub['prefill_ms']:>10.2f}")
    print(f"{'  on local-sync: decode ms/token':<34} {s['decode_ms']:>10.3f} {pub['decode_ms']:>10.2f}   min-max {s['decode_ms_min']:.3f}-{s['decode_ms_max']:.3f}")
    print(f"{'  on local-sync: pp=2 decode ms':<34} {s2['decode_ms']:>10.3f} {pub['pp2_decode_ms']:>10.2f}")
    total = sum(pp2["transfers"].values())
    print(f"{'pp=2 transfers in the MLIR':<34} {total:>10} {pub['pp2_transfers']:>10}")
    print(f"{'pp=2 transfers in decode':<34} {pp2['transfers']['decode_bs1']:>10} {pub['pp2_decode_transfers']:>10}"
          "   (the hidden state at the boundary, and the 8-byte position for stage 2)")
