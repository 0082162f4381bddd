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


# --- hosts named by place directives ---------------------------------------------------------
def _on(host, stage, devices):
    return {**_place(stage, devices), "host": host}


def test_a_placement_may_name_unequal_hosts():
    p = plan_from_directives(SHARED / "tp2-pp4-hosts-3-1.json", num_blocks=4, tp=2)
    assert p.host_of_stage == (0, 0, 0, 1) and p.host_count == 2
    assert [p.stages_of_host(h) for h in range(2)] == [range(0, 3), range(3, 4)]
    assert p.on_hosts(None) is p and p.on_hosts(2) is p
    assert ParallelPlan.from_dict(p.to_dict()) == p and p.to_dict()["host_of_stage"] == [0, 0, 0, 1]


def test_a_plan_naming_no_hosts_is_unchanged_and_splits_evenly():
    p = ParallelPlan.from_tp_pp(4, tp=2, pp=4)
    assert p.host_of_stage == () and p.host_count == 1 and "host_of_stage" not in p.to_dict()
    assert p.on_hosts(None) is p and p.on_hosts(1) is p and ParallelPlan.from_dict(p.to_dict()) == p
    assert p.on_hosts(2).host_of_stage == (0, 0, 1, 1) and p.on_hosts(4).host_of_stage == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "directives, match",
    [
        ([_on(0, 0, [0]), _place(1, [1])], "stage 0 names host 0 but stage 1 names none: name a host in every place directive or in none"),
        ([_place(0, [0]), _on(1, 1, [1])], "stage 1 names host 1 but stage 0 names none"),
        ([_on(1, 0, [0]), _on(1, 1, [1])], r"stage 0 is on host 1: hosts are numbered from 0 in stage order"),
        ([_on(0, 0, [0]), _on(2, 1, [1])], r"stage 1 is on host 2 after stage 0 on host 0: hosts are numbered from 0"),
        ([_on(0, 0, [0]), _on(1, 1, [1]), _on(0, 2, [2])], r"stage 2 is on host 0 after stage 1 on host 1: .* each holding consecutive stages \(host of each stage: \[0, 1, 0\]\)"),
        ([_on("a", 0, [0])], "stage 0 is on host 'a'"),
        ([_on(0, 0, [0]), _on(True, 1, [1])], "stage 1 is on host True after stage 0 on host 0"),
        ([_on(0, 0, [0]), _on(0, 1, [1]), _on(1, 2, [1])], r"device 1 holds stage 1 \(host 0\) and stage 2 \(host 1\): a device belongs to one host"),
    ],
)
def test_invalid_hosts_are_clear_errors(directives, match):
    with pytest.raises(PlanError, match=match):
        plan_from_directives(directives, num_blocks=4)


def test_hosts_given_must_match_the_hosts_named():
    p = plan_from_directives([_on(0, 0, [0]), _on(0, 1, [1]), _on(1, 2, [2])], num_blocks=4)
    for hosts in (1, 3):
        with pytest.raises(PlanError, match=rf"--hosts {hosts}, but the placement names 2 hosts \(host of each stage: \[0, 0, 1\]\)"):
            p.on_hosts(hosts)
    with pytest.raises(PlanError, match=r"--hosts 3 must divide the pipeline stages \(pp=4\)"):
        ParallelPlan.from_tp_pp(4, pp=4).on_hosts(3)
