"""`export --functions`: the kinds exported are exactly those named (for every batch size the
kind applies to), from the flag or a recipe; bad names and kinds the plan cannot have are
refused before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sharktank(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sharktank.cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _functions(d: Path) -> list[str]:
    return sorted(json.loads((d / "manifest.json").read_text())["functions"])


def test_the_named_kinds_are_exported_for_every_batch_size(tmp_path):
    out = tmp_path / "a"
    p = sharktank("export", "--model", "toy-llama", "--max-seq-len", "32", "--batch-sizes", "1,2", "--functions", "prefill, decode,prefill_row",
                  "--no-compile", "--output-dir", out)
    assert p.returncode == 0, p.stderr[-3000:]
    # prefill_row exists for batches of several rows only; prefill_rows and prefill_chunk were not named.
    assert _functions(out) == ["decode_bs1", "decode_bs2", "prefill_bs1", "prefill_bs2", "prefill_row_bs2"]


def test_a_recipe_names_the_functions(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('model = "toy-llama"\nmax_seq_len = 32\nfunctions = ["prefill", "decode"]\n')
    out = tmp_path / "b"
    p = sharktank("export", "--recipe", recipe, "--no-compile", "--output-dir", out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _functions(out) == ["decode_bs1", "prefill_bs1"]


def test_bad_function_lists_are_refused_before_anything_is_written(tmp_path):
    cases = [
        (["--functions", "prefill,decode,prefil_chunk"], "unknown function kinds ['prefil_chunk']"),
        (["--functions", "prefill,prefill_chunk"], "must include prefill and decode"),
        (["--functions", "prefill,decode,decode_paged"], "the paged ones come with a page size"),
        (["--pp", "2", "--hosts", "2", "--functions", "prefill,decode,prefill_chunk"],
         "function kinds ['prefill_chunk'] cannot be exported for a plan of 2 hosts"),
    ]
    for i, (flags, message) in enumerate(cases):
        out = tmp_path / f"bad{i}"
        p = sharktank("export", "--model", "toy-llama", *flags, "--no-compile", "--output-dir", out)
        assert p.returncode == 2, (flags, p.stderr[-2000:])
        assert message in p.stderr, (flags, p.stderr[-2000:])
        assert "Traceback" not in p.stderr
        assert not out.exists()
