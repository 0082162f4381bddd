"""Parallelism plans and placement directives: defaults, the shared files, every validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharktank.parallel import ParallelPlan, PlanError, contiguous_blocks, plan_from_directives

SHARED = Path(__file__).resolve().parents[2] / "exports" / "placements"  # copies of shared/placements


def test_tp_pp_default_layout():
    p = ParallelPlan.from_tp_pp(5, tp=2, pp=2)
    assert p.stage_of_block == (0, 0, 0, 1, 1)
    assert p.replicas == (((0, 1),), ((2, 3),)) and p.paths == ((0, 0),) and p.device_count == 4
    assert contiguous_blocks(7, 3) == (0, 0, 0, 1, 1, 2, 2)


def test_dualpipev_shared_file_gives_the_v():
    p = plan_from_directives(SHARED / "dualpipev-pp8-dp2.json", num_blocks=8)
    assert p.pp == 8 and p.device_count == 8 and len(p.paths) == 2
    assert [g[0] for g in p.path_devices(0)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [g[0] for g in p.path_devices(1)] == [4, 5, 6, 7, 7, 6, 5, 4]


def test_dualpipe_two_directions_with_path_directives():
    forward = {"op": "path", "devices": list(range(8))}
    backward = {"op": "path", "devices": list(range(7, -1, -1))}
    p = plan_from_directives([SHARED / "dualpipe-pp8-dp2.json", forward, backward], num_blocks=16)
    assert [g[0] for g in p.path_devices(0)] == list(range(8))
    assert [g[0] for g in p.path_devices(1)] == list(range(7, -1, -1))
    assert p.device_count == 16


def _place(stage, devices):
    return {"op": "place", "filter": {"PP": stage}, "devices": devices}


@pytest.mark.parametrize(
    "directives, tp, match",
    [
        ([_place(0, [0]), _place(1, [])], 1, "stage 1 has no devices"),
        ([_place(0, [0, 1, 2])], 2, r"3 devices \[0, 1, 2\] are not a multiple of tp=2"),
        ([_place(0, [0, 1]), _place(1, [1, 2])], 2, "identical or disjoint"),
        ([_place(0, [0]), _place(0, [1])], 1, "placed twice"),
        ([_place(0, [0]), _place(2, [1])], 1, r"no place directive for stage\(s\) \[1\]"),
        ([_place(0, [0]), _place(1, [1]), {"op": "path", "devices": [0, 2]}], 1, "uses device 2 at stage 1, which does not hold stage 1"),
        ([_place(0, [0]), {"op": "path", "devices": [0, 0]}], 1, "expected one per stage"),
        ([_place(0, [0, 0])], 1, "lists device 0 twice"),
        ([{"op": "shuffle"}], 1, "unknown op 'shuffle'"),
        ([], 1, "no 'place' directives"),
    ],
)
def test_invalid_directives_are_clear_errors(directives, tp, match):
    with pytest.raises(PlanError, match=match):
        plan_from_directives(directives, num_blocks=4, tp=tp)


def test_pp_mismatch_and_too_few_blocks():
    with pytest.raises(PlanError, match="pp=3 but the placement has 2 stages"):
        plan_from_directives([_place(0, [0]), _place(1, [1])], num_blocks=4, pp=3)
    with pytest.raises(PlanError, match="3 blocks cannot fill 4 pipeline stages"):
        ParallelPlan.from_tp_pp(3, pp=4)


def test_bad_placement_file(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="p.json is not valid JSON"):
        plan_from_directives(bad, num_blocks=2)
    with pytest.raises(PlanError, match="does not exist"):
        plan_from_directives(tmp_path / "missing.json", num_blocks=2)
