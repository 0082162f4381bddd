"""The harness (tools/bench.py): its exact rows (transfer counts and bytes) and its command
line. Nothing here asserts a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_collectives import coalesce_rows, collective_rows

ROOT = Path(__file__).resolve().parents[2]


def test_collective_rows_are_bandwidth_optimal_in_eager():
    rows = collective_rows((2, 4, 8), export=False)
    assert {(r["op"], r["n"]) for r in rows} == {(op, n) for op in ("all_gather", "reduce_scatter", "all_reduce") for n in (2, 4, 8)}
    for r in rows:
        assert r["met"], r
        if r["n"] > 2:  # no device carries (N-1)x the tensor (at N=2, 2(N-1)/N is N-1)
            assert r["eager"]["received_max"] < r["n"] - 1


def test_coalesce_rows_count_one_transfer_per_bucket_per_pair():
    rows = coalesce_rows(n=2, export=False, rounds=1)
    for r in rows:
        for key in ("per_tensor", "coalesced", "coalesced_small"):
            assert r[key]["eager"] == r[key]["expected"], (r["case"], key)
        assert r["coalesced"]["eager"] < r["per_tensor"]["eager"]
        assert r["coalesced"]["eager_max_sent"] == r["per_tensor"]["eager_max_sent"]  # same bytes, fewer transfers


def test_command_line_writes_json_with_targets(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--skip-eager", "--skip-import", "--skip-compiled", "--no-export", "--json", str(out)]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "== collectives" in text and "== coalesced transfers" in text and "== targets" in text
    results = json.loads(out.read_text())
    summary = {r["target"]: r for r in results["summary"]}
    assert summary["collectives_bandwidth_optimal"]["met"] and summary["coalesced_transfers"]["met"]
    assert "compiled" not in results and "eager" not in results
    # toy-llama-3l: the two export + compile quantities are separate rows, compared with the
    # public package's figures from another run and not judged; decode vs eager is judged.
    tp1 = results["reference"]["builds"]["tp1"]
    wall, inproc = summary["t3l_export_compile_cli_wall_s"], summary["t3l_export_compile_in_process_s"]
    assert "t3l_export_compile_s" not in summary
    assert wall["measured"] == tp1["wall_s"] and inproc["measured"] == tp1["export_s"] + tp1["compile_s"]
    assert wall["measured"] > inproc["measured"]  # the CLI run includes the in-process work
    for name in ("t3l_export_compile_cli_wall_s", "t3l_export_compile_in_process_s", "t3l_prefill_ms", "t3l_decode_ms"):
        assert not summary[name]["judged"] and summary[name]["met"] is None and summary[name]["reference"] == "another run"
        assert any(line.startswith(name) and line.endswith("constant from another run, not judged") for line in text.splitlines())
    assert summary["t3l_decode_speedup_vs_eager"]["judged"] and summary["t3l_decode_speedup_vs_eager"]["met"] in (True, False)


def test_profile_prints_where_the_time_goes():
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--profile", "matmul_3shard"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "tottime" in text and "function calls" in text
