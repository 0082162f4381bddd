"""How a plan over hosts becomes per-host plans (no tracing): local device numbers, refusals."""

from __future__ import annotations

import pytest

from sharktank.export.hosts import host_plan
from sharktank.parallel import PlanError, plan_from_directives


def _on(host, stage, devices):
    return {"op": "place", "filter": {"PP": stage}, "devices": devices, "host": host}


def test_each_host_numbers_its_devices_from_zero():
    plan = plan_from_directives([_on(0, 0, [4, 5]), _on(0, 1, [0, 1]), _on(0, 2, [2, 3]), _on(1, 3, [8, 9])], num_blocks=4, tp=2)
    local, maps = host_plan(plan)
    # In the order of their global numbers, whatever order the stages use them in.
    assert maps == [{0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}, {8: 0, 9: 1}]
    assert local.replicas == (((4, 5),), ((0, 1),), ((2, 3),), ((0, 1),)) and local.host_of_stage == ()


@pytest.mark.parametrize(
    "extra, found",
    [([], r"\[2, 1\] groups per stage and 2 paths"), ([{"op": "path", "devices": [0, 2]}], r"\[2, 1\] groups per stage and 1 paths")],
)
def test_replicas_and_paths_cannot_cross_hosts(extra, found):
    plan = plan_from_directives([_on(0, 0, [0, 1]), _on(1, 1, [2]), *extra], num_blocks=2)
    with pytest.raises(PlanError, match=r"a multi-host export needs one device group per stage and one path \(no replicas or path directives\); found " + found):
        host_plan(plan)
