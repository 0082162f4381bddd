"""tools/soak_serve.py, CI-sized: a live `sharktank serve` (subprocess on 127.0.0.1) of the toy
artifact over a pool of 6 pages of 8 positions (two rows of up to 44 positions each need 6),
30 requests of shared and unshared prompts, 4 in flight, streamed, plain, disconnected after a
few tokens and given up on before an answer. Every answer that completed equals the one the
same server gave it alone; no page is held at the end; /health answered throughout."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from soak_serve import plan, run  # noqa: E402
from toy_artifact import PAGE, toy_artifact  # noqa: E402


def test_the_plan_mixes_every_mode_and_shares_prefixes():
    jobs = plan(30, 0, 256, 32, 8)
    assert {j.mode for j in jobs} == {"stream", "plain", "disconnect", "give_up"}
    firsts = [j.prompt[0] for j in jobs]
    assert len(set(firsts)) < len(firsts) // 2  # most prompts start from one of three stems
    assert all(1 <= len(j.prompt) <= 32 and 1 <= j.max_tokens <= 8 for j in jobs)


def test_a_mixed_load_with_disconnects_over_a_small_pool(tmp_path_factory):
    # Requests of up to 20 + 24 tokens (6 pages) over 6 pages: the two rows' requests outgrow the
    # pool (preemptions depend on the requests' timing: 3-5 in probe runs of seeds 2 and 3).
    report = run(str(toy_artifact(tmp_path_factory)), requests=30, concurrency=4, kv_pages=6, seed=2, max_prompt=20, max_tokens=24)
    assert report["kv_pages"] == 6 and PAGE == 8
    assert report["wrong"] == [] and report["failed"] == [], report
    assert report["health_failures"] == [] and report["health_checks"] >= 1
    assert report["kv_pages_used_after"] == 0 and report["rows_running_after"] == 0  # nothing leaked
    outcomes = report["outcomes"]
    assert outcomes.get("done", 0) >= 10 and outcomes.get("disconnected", 0) >= 1, outcomes
    assert report["prefix_cache_hit_tokens"] > 0  # shared prefixes were reused, over evictions
    assert report["ok"]
