"""Every example in examples/ runs as a user would run it (its own process, from the repo
root) and reaches the result it checks: each exits 1 when its own comparison fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# example -> lines its output must hold (beyond exiting 0)
EXPECT = {
    "export_function.py": ["exported: 2 transfers", "2 results (y on each device)"],
    "export_hf_checkpoint.py": ["transfers per function", "compiled ids:", "max |eager - transformers| on the prompt"],
    "serve_and_query.py": ["answered", "streamed in", "a wrong key is refused (401): True"],
    "two_hosts_one_machine.py": ["one program:", "two hosts:"],
}


def test_every_example_is_run_here():
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == set(EXPECT) | {"sharded_ffn.py"}  # sharded_ffn: tests/test_project.py


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    for line in EXPECT[name]:
        assert line in p.stdout, (line, p.stdout[-2000:])
