"""Helpers shared by the reliability tests and tools/soak.py: artifacts built once per run,
killing an export at a chosen point, judging what it left behind, and memory figures."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOAK = os.environ.get("SHARKTANK_SOAK") == "1"


def soak(test):
    """Mark a soak test: skipped unless SHARKTANK_SOAK=1; ``-m soak`` selects them."""
    skip = pytest.mark.skipif(not SOAK, reason="soak test, not CI: opt in with SHARKTANK_SOAK=1 (or run python tools/soak.py)")
    return pytest.mark.soak(skip(test))


__all__ = [
    "ROOT", "SOAK", "soak", "shared_dir", "build_once", "build_toy", "TOY_MAX_SEQ_LEN", "shared_toy", "save_small_model",
    "KillResult", "run_and_kill", "artifact_state", "tree_digest", "judge_after_kill", "rss_bytes",
]


# --- artifacts built once per test run -----------------------------------------------------------


def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this run sees (the parent of the per-worker temp dirs)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reliability-shared"
    root.mkdir(exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(root: Path, name: str, build: Callable[[Path], None], marker: str = "manifest.json") -> Path:
    """``root/name`` built by ``build`` exactly once across processes (a file lock serializes);
    built means ``root/name/marker`` exists (``build`` writes it last)."""
    out = root / name
    with _locked(root / f".{name}.lock"):
        if not (out / marker).exists():
            build(out)
    return out


def build_toy(out: Path, max_seq_len: int, compile: bool = True) -> None:
    """The compiled toy-llama (tp=1, batch 1, prefill and decode) with a KV cache of ``max_seq_len``."""
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    export_artifact(load_model("toy-llama"), out, source="toy-llama", batch_sizes=(1,), max_seq_len=max_seq_len, compile=compile,
                    functions=("prefill", "decode"))


# 8 prompt tokens + 64 decode steps fit; the soak builds its own 1040-long one.
TOY_MAX_SEQ_LEN = 80


def shared_toy(tmp_path_factory) -> Path:
    """The :func:`build_toy` artifact with a cache of TOY_MAX_SEQ_LEN, built once per run for
    every test that reads it (the reliability tests, test_text_cli). Treat it as read-only:
    tests that damage an artifact work on a copy."""
    return build_once(shared_dir(tmp_path_factory), "toy", lambda out: build_toy(out, TOY_MAX_SEQ_LEN))


def save_small_model(path: Path, num_layers: int = 1):
    """A tiny Llama saved as ``.irpa`` (fast to export: the kill tests export it many times)."""
    from sharktank.models import save_model_irpa
    from sharktank.models.llama.config import LlamaConfig
    from sharktank.models.llama.presets import random_theta

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=num_layers, num_heads=4, num_kv_heads=2, max_seq_len=32)
    theta = random_theta(config)
    save_model_irpa(path, config, theta)
    return config, theta


# --- interrupted exports ---------------------------------------------------------------------------


@dataclass
class KillResult:
    killed: bool  # False: it finished (or failed) before the kill point
    returncode: int
    marker_seen: bool
    seconds: float
    stderr: list[str] = field(default_factory=list)  # every line it printed before it ended

    @property
    def stderr_tail(self) -> list[str]:
        return self.stderr[-5:]


def run_and_kill(args: list[str], *, marker: str | None, delay: float, timeout: float = 400) -> KillResult:
    """Run ``python -m sharktank.cli *args`` in its own process group; once ``marker`` appears on
    its stderr (at once when None), wait ``delay`` seconds and SIGKILL the whole group."""
    t0 = time.monotonic()
    p = subprocess.Popen(
        [sys.executable, "-m", "sharktank.cli", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    seen = threading.Event()
    lines: list[str] = []

    def read():
        for line in p.stderr:
            lines.append(line.rstrip())
            if marker is not None and marker in line:
                seen.set()
        seen.set()  # EOF: the process is gone

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if marker is not None:
        seen.wait(timeout)
    time.sleep(delay)
    killed = p.poll() is None
    if killed:
        os.killpg(p.pid, signal.SIGKILL)
    rc = p.wait(timeout=60)
    reader.join(timeout=10)
    return KillResult(killed, rc, marker is None or any(marker in x for x in lines), time.monotonic() - t0, lines)


def tree_digest(d: Path) -> str:
    """sha256 over every file's relative path and bytes (order-independent of the walk)."""
    h = hashlib.sha256()
    for p in sorted(x for x in d.rglob("*") if x.is_file()):
        h.update(str(p.relative_to(d)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def artifact_state(d: Path) -> str:
    """``absent``; ``complete`` (the manifest reads and every file it names is there with its
    sha256); ``refused: <why>`` (the readers refuse it); or ``half-written: <what>`` (the manifest
    reads but a file it names is missing or differs: what must never happen)."""
    from sharktank.runtime import ArtifactError, read_manifest
    from sharktank.weights._files import sha256_file

    if not d.exists():
        return "absent"
    try:
        m = read_manifest(d)
    except ArtifactError as e:
        return f"refused: {e}"
    named = {name: f.get("sha256") for name, f in m.parameters["files"].items()}
    named[m.module["mlir"]] = None
    if m.module.get("vmfb"):
        named[m.module["vmfb"]] = m.module.get("vmfb_sha256")
    for name, sha in named.items():
        f = d / name
        if not f.is_file():
            return f"half-written: {name} is missing"
        if sha is not None and sha256_file(f) != sha:
            return f"half-written: {name} does not match its sha256"
    return "complete"


def judge_after_kill(out: Path, old_digest: str | None) -> tuple[str, list[str]]:
    """What an interrupted export left: the state of ``out`` ("old", "absent", "new") and the
    leftovers beside it. Fails (AssertionError) on anything a later ``run`` could mistake for
    a good artifact."""
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name != out.name)
    for name in leftovers:
        # Documented leftovers: the export's hidden build directory and the previous output
        # while it is being swapped out. Never an artifact under the requested name.
        assert name.startswith(f".{out.name}.") and (name.endswith(".tmp") or ".old-" in name), f"unexpected {name} beside {out}"
        state = artifact_state(out.parent / name)
        assert not state.startswith("half-written"), f"leftover {name}: {state}"
    state = artifact_state(out)
    assert state in ("absent", "complete"), f"{out}: {state}"
    if state == "absent":
        if old_digest is not None:
            # Killed between the two renames of the swap: the old output is intact beside it.
            olds = [n for n in leftovers if ".old-" in n]
            assert any(tree_digest(out.parent / n) == old_digest for n in olds), f"old output lost: {leftovers}"
        return "absent", leftovers
    if old_digest is not None and tree_digest(out) == old_digest:
        return "old", leftovers
    return "new", leftovers


def kill_plan(seed: int, phases: list[tuple[str, float]]) -> list[tuple[str | None, float]]:
    """Seeded kill points: (stderr marker or None, delay drawn uniformly in [0, max])."""
    rng = random.Random(seed)
    return [(marker, rng.uniform(0, top)) for marker, top in phases]


# --- memory ------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process from /proc/self/statm (pages x page size)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
