"""The toy-llama artifacts the multi-host tests share, exported once per test run (whichever
xdist worker asks first builds them; the others wait for it and reuse them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from reliability.reltools import build_once, shared_dir

ROOT = Path(__file__).resolve().parents[2]
EXPORT_LIMIT_S = 300
# name -> export flags: one host tp2×pp2, tp2×pp2 over 2 hosts, pp4 over 4 hosts, tp2×pp4 over
# 2 hosts holding 3 stages and 1 (as the recipe's placement file names them) and the same
# stages on one host. Batch 4 (with prefill_row) is what `serve` batches over; batch 1 is what
# `run --tokens` takes. The one-host artifacts export only the kinds the hosts' programs have
# (prefill, decode, prefill_row), which the tests compare them with.
ARTIFACTS = {
    "single": ["--tp", "2", "--pp", "2", "--batch-sizes", "1,4", "--functions", "prefill,decode,prefill_row"],
    "tp2pp2x2": ["--tp", "2", "--pp", "2", "--hosts", "2", "--batch-sizes", "1,4"],
    "pp4x4": ["--pp", "4", "--hosts", "4"],
    "tp2pp4x2-uneven": ["--recipe", "exports/toy-llama-hosts-3-1.toml"],
    "tp2pp4": ["--tp", "2", "--pp", "4", "--functions", "prefill,decode"],
}


def _build(out: Path) -> None:
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "sharktank.cli", "export", "--model", "toy-llama", "--max-seq-len", "32"]
    procs = {name: subprocess.Popen([*cmd, *flags, "--output-dir", str(out / name)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, flags in ARTIFACTS.items()}
    try:
        for name, p in procs.items():
            _, err = p.communicate(timeout=EXPORT_LIMIT_S)
            assert p.returncode == 0, f"export {name} failed:\n{err[-3000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    (out / "built").write_text("")


def hosts_artifacts(tmp_path_factory) -> dict[str, Path]:
    """``{name: directory}`` of :data:`ARTIFACTS`, built once per run."""
    base = build_once(shared_dir(tmp_path_factory), "hosts-artifacts", _build, marker="built")
    return {name: base / name for name in ARTIFACTS}
