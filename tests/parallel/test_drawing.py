"""The placement drawings (sharktank.parallel.drawing) say what the plan says: each path's
letter sits in the column of the device that runs its stage, the routes are the plan's
path_devices, and the SVG is a well-formed picture with one line per path. The SVG and the PNG
are the same scene: the SVG holds its every shape and text, the PNG is its size and paints each
path's colour and each text where the scene puts it."""

from __future__ import annotations

import io
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sharktank.parallel import ParallelPlan
from sharktank.parallel.directives import plan_from_directives
from sharktank.parallel.drawing import _COLOURS, Circle, Polyline, Rect, Text, draw_png, draw_svg, draw_text, grid, path_name, scene

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


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_svg_is_the_scene(name):
    plan = PLANS[name]().to_dict()
    sc = scene(plan, {0: 5, 1: 1234}, title=f"{name} <&>")
    root = ET.fromstring(draw_svg(plan, {0: 5, 1: 1234}, title=f"{name} <&>"))
    ns = "{http://www.w3.org/2000/svg}"
    assert (int(root.get("width")), int(root.get("height"))) == (sc.width, sc.height)
    texts = [(float(t.get("x")), float(t.get("y")), t.get("text-anchor", "start"), t.text) for t in root.iter(f"{ns}text")]
    assert texts == [(t.x, t.y, t.anchor, t.text) for t in sc.items if isinstance(t, Text)]
    assert "weights" in [t[3] for t in texts] and "1.2 kB" in [t[3] for t in texts]
    lines = [[tuple(map(float, pt.split(","))) for pt in e.get("points").split()] for e in root.iter(f"{ns}polyline")]
    assert lines == [list(p.points) for p in sc.items if isinstance(p, Polyline)]
    assert [e.get("fill") for e in root.iter(f"{ns}rect")] == [r.fill for r in sc.items if isinstance(r, Rect)]
    assert len(root.findall(f"{ns}circle")) == sum(isinstance(c, Circle) for c in sc.items) == len(plan["paths"]) * plan["pp"]


def _near(counts: list[tuple[int, tuple[int, int, int]]], colour: str, tol: int = 12) -> int:
    """How many pixels (``counts``: Image.getcolors) are within ``tol`` of ``colour`` in each channel."""
    rgb = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return sum(n for n, px in counts if all(abs(a - b) <= tol for a, b in zip(px, rgb)))


@pytest.mark.parametrize("name", ["dualpipev-pp4-dp2", "dualpipe-pp8-dp2", "tp2xpp2"])
@pytest.mark.parametrize("scale", [1, 2])
def test_the_png_paints_the_scene(name, scale):
    from PIL import Image

    plan = PLANS[name]().to_dict()
    sc = scene(plan, {0: 5}, title=name)
    image = Image.open(io.BytesIO(draw_png(plan, {0: 5}, title=name, scale=scale)))
    assert image.format == "PNG" and image.size == (sc.width * scale, sc.height * scale)
    image = image.convert("RGB")
    counts = image.getcolors(image.width * image.height)
    n_paths = len(plan["paths"])
    for p in range(len(_COLOURS)):
        # Each path's dots (r=4) alone cover pp * ~50 pixels of its colour; an unused colour is absent.
        count = _near(counts, _COLOURS[p])
        assert (count >= plan["pp"] * 40 * scale**2) if p < n_paths else count == 0, (p, count)
    # Every text is inked just above its baseline: starting at its x (nothing left of it), or
    # (middle) on both sides of its x.
    grey = image.convert("L")
    ink = lambda x0, x1, t: grey.crop([round(v * scale) for v in (x0, t.y - t.size * 0.6, x1, t.y - 1)]).getextrema()[0]  # noqa: E731
    for t in (t for t in sc.items if isinstance(t, Text)):
        if t.anchor == "start":
            assert ink(t.x, t.x + 16, t) < 128 and ink(t.x - 6, t.x - 1, t) > 200, t
        else:
            assert ink(t.x - 8, t.x - 2, t) < 128 and ink(t.x + 2, t.x + 8, t) < 128, t


def test_the_png_without_pillow_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # `import PIL` now fails as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'sharktank\[draw\]'"):
        draw_png(PLANS["tp2xpp2"]().to_dict())
