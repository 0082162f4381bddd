"""Pictures of a parallel plan: devices as columns, pipeline stages as rows, and each
microbatch path traced through them (``sharktank inspect`` prints the text form and writes the
SVG form with ``--svg``).

A plan here is :meth:`~sharktank.parallel.ParallelPlan.to_dict`'s form (what a manifest's
``parallel`` holds): ``replicas[s]`` lists stage ``s``'s replicas, each a group of ``tp``
devices; ``paths[p][s]`` is the replica path ``p`` uses at stage ``s``. Paths are named
``A``, ``B``, ...; a cell shows the paths that run stage ``s`` on that device (``.`` for a
replica no path uses), so reading a letter down the rows follows its microbatch from the
first stage to the last (DualPipe's two directions, DualPipeV's V).
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Mapping, Sequence

__all__ = ["Grid", "grid", "draw_text", "draw_svg", "path_name"]

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def path_name(p: int) -> str:
    """``A`` .. ``Z``, then ``P26``, ...: the name of path ``p`` in the drawings."""
    return chr(ord("A") + p) if p < 26 else f"P{p}"


@dataclass(frozen=True)
class Grid:
    """What the drawings show: ``cells[s][d]`` is None where stage ``s`` has no replica on
    device ``d``, else the paths (indices) that run stage ``s`` there (empty: an idle replica);
    ``route[p]`` is path ``p``'s (stage, devices) in stage order."""

    devices: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    cells: tuple[tuple[tuple[int, ...] | None, ...], ...]
    route: tuple[tuple[tuple[int, ...], ...], ...]
    host_of_stage: tuple[int, ...]


def grid(plan: Mapping) -> Grid:
    """The :class:`Grid` of a plan dict (see the module docstring)."""
    replicas, paths = plan["replicas"], plan["paths"]
    devices = tuple(sorted({d for reps in replicas for group in reps for d in group}))
    column = {d: i for i, d in enumerate(devices)}
    stages = len(replicas)
    blocks = tuple(tuple(b for b, s in enumerate(plan["stage_of_block"]) if s == stage) for stage in range(stages))
    cells: list[list[list[int] | None]] = [[None] * len(devices) for _ in range(stages)]
    for s, reps in enumerate(replicas):
        for r, group in enumerate(reps):
            users = [p for p, path in enumerate(paths) if path[s] == r]
            for d in group:
                cells[s][column[d]] = users
    route = tuple(tuple(tuple(replicas[s][path[s]]) for s in range(stages)) for path in paths)
    return Grid(devices, blocks, tuple(tuple(None if c is None else tuple(c) for c in row) for row in cells), route, tuple(plan.get("host_of_stage") or ()))


def _blocks(blocks: Sequence[int]) -> str:
    if not blocks:
        return "no blocks"
    if list(blocks) == list(range(blocks[0], blocks[-1] + 1)) and len(blocks) > 1:
        return f"blocks {blocks[0]}-{blocks[-1]}"
    return "block " + ",".join(map(str, blocks)) if len(blocks) == 1 else "blocks " + ",".join(map(str, blocks))


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def draw_text(plan: Mapping, bytes_per_device: Mapping[int, int] | None = None) -> str:
    """The plan as a table in text: a column per device, a row per stage, each cell the paths
    running that stage there, then each path's route and (when given) the parameter bytes each
    device holds."""
    g = grid(plan)
    cell = lambda users: "." if users == () else "" if users is None else " ".join(path_name(p) for p in users)  # noqa: E731
    body = [[cell(c) for c in row] for row in g.cells]
    width = max([len(f"dev {d}") for d in g.devices] + [len(c) for row in body for c in row] + ([len(_bytes(b)) for b in bytes_per_device.values()] if bytes_per_device else []))
    label = max(len(f"stage {len(g.cells) - 1}"), len("weights"))
    line = lambda first, cols, last="": f"{first:<{label}}  " + "  ".join(f"{c:^{width}}" for c in cols) + (f"  {last}" if last else "")  # noqa: E731
    out = [f"tp={plan['tp']} pp={plan['pp']}, {len(g.devices)} devices, {len(g.route)} path{'s' if len(g.route) != 1 else ''} "
           f"({', '.join(path_name(p) for p in range(len(g.route)))}); a cell lists the paths running that stage on that device",
           line("", [f"dev {d}" for d in g.devices])]
    for s, row in enumerate(body):
        host = f", host {g.host_of_stage[s]}" if g.host_of_stage else ""
        out.append(line(f"stage {s}", row, _blocks(g.blocks[s]) + host))
    if bytes_per_device:
        out.append(line("weights", [_bytes(bytes_per_device.get(d, 0)) for d in g.devices]))
    for p, stops in enumerate(g.route):
        out.append(f"path {path_name(p)}: " + " -> ".join("dev " + "+".join(map(str, group)) for group in stops))
    return "\n".join(out)


def draw_svg(plan: Mapping, bytes_per_device: Mapping[int, int] | None = None, title: str = "") -> str:
    """The same picture as an SVG document: replicas as shaded cells, each path a coloured
    line through the cells it runs in, stage by stage."""
    g = grid(plan)
    cw, ch, left, top = 90, 44, 150, 60 + (20 if title else 0)
    n_paths = len(g.route)
    height = top + ch * len(g.cells) + (40 if bytes_per_device else 10) + 22 * n_paths + 10
    width = left + cw * len(g.devices) + 20
    col = {d: i for i, d in enumerate(g.devices)}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="13">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="10" y="20" font-weight="bold">{escape(title)}</text>')
    for d in g.devices:
        out.append(f'<text x="{left + col[d] * cw + cw / 2}" y="{top - 12}" text-anchor="middle">dev {d}</text>')
    for s, row in enumerate(g.cells):
        y = top + s * ch
        host = f" (host {g.host_of_stage[s]})" if g.host_of_stage else ""
        out.append(f'<text x="10" y="{y + ch / 2 - 2}">stage {s}{host}</text>')
        out.append(f'<text x="10" y="{y + ch / 2 + 13}" fill="#666" font-size="11">{escape(_blocks(g.blocks[s]))}</text>')
        for i, users in enumerate(row):
            fill = "#f4f4f4" if users is None else "#dde8f5" if users else "#eeeeee"
            out.append(f'<rect x="{left + i * cw + 2}" y="{y + 2}" width="{cw - 4}" height="{ch - 4}" rx="4" fill="{fill}" stroke="#bbb"/>')
    for p, stops in enumerate(g.route):
        colour = _COLOURS[p % len(_COLOURS)]
        dx = (p - (n_paths - 1) / 2) * min(12, (cw - 20) / max(n_paths, 1))
        points = []
        for s, group in enumerate(stops):
            x = left + sum(col[d] for d in group) / len(group) * cw + cw / 2 + dx
            points.append(f"{x:.1f},{top + s * ch + ch / 2:.1f}")
        out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{colour}" stroke-width="3" opacity="0.85"/>')
        for pt in points:
            x, y = pt.split(",")
            out.append(f'<circle cx="{x}" cy="{y}" r="4" fill="{colour}"/>')
    y = top + ch * len(g.cells) + 18
    if bytes_per_device:
        out.append(f'<text x="10" y="{y}">weights</text>')
        for d in g.devices:
            out.append(f'<text x="{left + col[d] * cw + cw / 2}" y="{y}" text-anchor="middle">{_bytes(bytes_per_device.get(d, 0))}</text>')
        y += 30
    for p in range(n_paths):
        colour = _COLOURS[p % len(_COLOURS)]
        stops = " -> ".join("+".join(map(str, group)) for group in g.route[p])
        out.append(f'<line x1="10" y1="{y - 4}" x2="34" y2="{y - 4}" stroke="{colour}" stroke-width="3"/>')
        out.append(f'<text x="42" y="{y}">path {path_name(p)}: devices {escape(stops)}</text>')
        y += 22
    out.append("</svg>")
    return "\n".join(out)
