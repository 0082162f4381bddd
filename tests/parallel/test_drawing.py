"""The placement drawings (sharktank.parallel.drawing) say what the plan says: each path's
letter sits in the column of the device that runs its stage, the routes are the plan's
path_devices, and the SVG is a well-formed picture with one line per path."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sharktank.parallel import ParallelPlan
from sharktank.parallel.directives import plan_from_directives
from sharktank.parallel.drawing import draw_svg, draw_text, grid, path_name

PLACEMENTS = Path(__file__).resolve().parents[2] / "exports" / "placements"
PLANS = {
    "tp2xpp2": lambda: ParallelPlan.from_tp_pp(4, tp=2, pp=2),
    "dualpipev-pp4-dp2": lambda: plan_from_directives(PLACEMENTS / "dualpipev-pp4-dp2.json", 4),
    "dualpipev-pp8-dp2": lambda: plan_from_directives(PLACEMENTS / "dualpipev-pp8-dp2.json", 16),
    "dualpipe-pp8-dp2": lambda: plan_from_directives(PLACEMENTS / "dualpipe-pp8-dp2.json", 8),
    "tp2-pp4-hosts-3-1": lambda: plan_from_directives(PLACEMENTS / "tp2-pp4-hosts-3-1.json", 4, tp=2),
}


def _columns(text: str) -> tuple[dict[int, int], list[str]]:
    """The character column of each device's header and the stage rows of a text drawing."""
    lines = text.splitlines()
    header = lines[1]
    cols = {}
    for part in header.split("dev ")[1:]:
        d = int(part.split()[0])
        cols[d] = header.index(f"dev {d} ") if f"dev {d} " in header else header.index(f"dev {d}")
    return cols, [line for line in lines if line.startswith("stage ")]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_each_letter_sits_under_the_device_that_runs_the_stage(name):
    plan = PLANS[name]()
    text = draw_text(plan.to_dict(), {d: 1000 * (d + 1) for d in range(plan.device_count)})
    cols, rows = _columns(text)
    width = len("dev 10") if max(cols) >= 10 else len("dev 0")
    assert len(rows) == plan.pp
    for s, row in enumerate(rows):
        for p in range(len(plan.paths)):
            for d in plan.path_devices(p)[s]:
                cell = row[cols[d] - 2 : cols[d] + width + 2]
                assert path_name(p) in cell.split(), (name, s, p, d, row)
        # No letter where the stage has no replica.
        held = {d for group in plan.replicas[s] for d in group}
        for d in set(cols) - held:
            assert not row[cols[d] : cols[d] + width].strip(), (name, s, d, row)
    for p in range(len(plan.paths)):
        route = " -> ".join("dev " + "+".join(map(str, g)) for g in plan.path_devices(p))
        assert f"path {path_name(p)}: {route}" in text
    assert "weights" in text and "1.0 kB" in text
    if plan.host_of_stage:
        assert all(f"host {plan.host_of_stage[s]}" in rows[s] for s in range(plan.pp))


def test_the_grid_marks_idle_replicas_and_empty_cells():
    # Two replicas of one stage, one path using the second: the first is idle ('.').
    plan = {"tp": 1, "pp": 1, "stage_of_block": [0, 0], "replicas": [[[0], [1]]], "paths": [[1]]}
    g = grid(plan)
    assert g.cells == (((), (0,)),) and g.route == (((1,),),)
    assert draw_text(plan).splitlines()[2].split() == ["stage", "0", ".", "A", "blocks", "0-1"]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_svg_has_one_line_per_path_through_every_stage(name):
    plan = PLANS[name]()
    root = ET.fromstring(draw_svg(plan.to_dict(), {0: 5}, title=f"{name} <&>"))
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == len(plan.paths)
    assert all(len(line.get("points").split()) == plan.pp for line in lines)
    assert len(root.findall(f"{ns}rect")) == 1 + plan.device_count * plan.pp  # the background and a cell per stage and device
    assert any(t.text == f"{name} <&>" for t in root.iter(f"{ns}text"))
