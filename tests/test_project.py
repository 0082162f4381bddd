"""The example (the README's main job) and the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_example_checks_against_torch_and_prints_transfers():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "sharded_ffn.py")], capture_output=True, text=True, check=True).stdout
    assert "tensor parallel, 4 devices" in out and "pipeline, 2 stages x 2 devices" in out
    assert "transfers (24, " in out  # one all_reduce over 4 devices: 2*4*3
    assert "0 -> 2 [4, 32] float32" in out  # the stage boundary, moved by transfer-if-needed
    assert out.strip().splitlines()[-1].startswith("OK")


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "sharktank.cli", "--help"], capture_output=True, text=True, check=True).stdout
    assert "usage: sharktank" in out and "--version" in out
