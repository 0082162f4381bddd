"""Pictures of a parallel plan: devices as columns, pipeline stages as rows, and each
microbatch path traced through them (``sharktank inspect`` prints the text form and writes the
SVG and PNG forms with ``--svg`` and ``--png``).

A plan here is :meth:`~sharktank.parallel.ParallelPlan.to_dict`'s form (what a manifest's
``parallel`` holds): ``replicas[s]`` lists stage ``s``'s replicas, each a group of ``tp``
devices; ``paths[p][s]`` is the replica path ``p`` uses at stage ``s``. Paths are named
``A``, ``B``, ...; a cell shows the paths that run stage ``s`` on that device (``.`` for a
replica no path uses), so reading a letter down the rows follows its microbatch from the
first stage to the last (DualPipe's two directions, DualPipeV's V).

Both pictures are one :func:`scene` (a canvas and small shapes in SVG units): :func:`draw_svg`
writes it as text, :func:`draw_png` paints it with Pillow (the ``draw`` extra, imported only then).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from html import escape
from typing import Literal, Mapping, Sequence

__all__ = ["Grid", "grid", "draw_text", "path_name", "Scene", "Rect", "Polyline", "Circle", "Line", "Text", "scene", "draw_svg", "draw_png"]

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


@dataclass(frozen=True)
class Rect:
    """A filled rectangle, its corners rounded by ``radius``, outlined (1 unit) in ``stroke``."""

    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str | None = None
    radius: float = 0


@dataclass(frozen=True)
class Polyline:
    """An open line through ``points``, ``width`` units wide, drawn over what lies below at ``opacity``."""

    points: tuple[tuple[float, float], ...]
    colour: str
    width: float
    opacity: float = 1.0


@dataclass(frozen=True)
class Circle:
    x: float
    y: float
    r: float
    fill: str


@dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    colour: str
    width: float


@dataclass(frozen=True)
class Text:
    """One line of sans-serif text whose baseline starts at (or, ``middle``, is centred on) ``x, y``."""

    x: float
    y: float
    text: str
    anchor: Literal["start", "middle"] = "start"
    size: float = 13
    weight: Literal["normal", "bold"] = "normal"
    colour: str = "black"


@dataclass(frozen=True)
class Scene:
    """A picture: a ``width`` x ``height`` canvas and its shapes, painted in order."""

    width: int
    height: int
    items: tuple[Rect | Polyline | Circle | Line | Text, ...]


def scene(plan: Mapping, bytes_per_device: Mapping[int, int] | None = None, title: str = "") -> Scene:
    """The picture of a plan: replicas as shaded cells, each path a coloured line through the
    cells it runs in, stage by stage, then each device's parameter bytes and a legend."""
    g = grid(plan)
    cw, ch, left, top = 90, 44, 150, 60 + (20 if title else 0)
    n_paths = len(g.route)
    height = top + ch * len(g.cells) + (40 if bytes_per_device else 10) + 22 * n_paths + 10
    width = left + cw * len(g.devices) + 20
    col = {d: i for i, d in enumerate(g.devices)}
    centre = lambda d: left + col[d] * cw + cw / 2  # noqa: E731
    out: list = [Rect(0, 0, width, height, "white")]
    if title:
        out.append(Text(10, 20, title, weight="bold"))
    out += [Text(centre(d), top - 12, f"dev {d}", anchor="middle") for d in g.devices]
    for s, row in enumerate(g.cells):
        y = top + s * ch
        host = f" (host {g.host_of_stage[s]})" if g.host_of_stage else ""
        out += [Text(10, y + ch / 2 - 2, f"stage {s}{host}"), Text(10, y + ch / 2 + 13, _blocks(g.blocks[s]), size=11, colour="#666")]
        for i, users in enumerate(row):
            fill = "#f4f4f4" if users is None else "#dde8f5" if users else "#eeeeee"
            out.append(Rect(left + i * cw + 2, y + 2, cw - 4, ch - 4, fill, stroke="#bbb", radius=4))
    for p, stops in enumerate(g.route):
        colour = _COLOURS[p % len(_COLOURS)]
        dx = (p - (n_paths - 1) / 2) * min(12, (cw - 20) / max(n_paths, 1))
        points = tuple((round(sum(centre(d) for d in group) / len(group) + dx, 1), round(top + s * ch + ch / 2, 1)) for s, group in enumerate(stops))
        out.append(Polyline(points, colour, 3, opacity=0.85))
        out += [Circle(x, y, 4, colour) for x, y in points]
    y = top + ch * len(g.cells) + 18
    if bytes_per_device:
        out.append(Text(10, y, "weights"))
        out += [Text(centre(d), y, _bytes(bytes_per_device.get(d, 0)), anchor="middle") for d in g.devices]
        y += 30
    for p, stops in enumerate(g.route):
        colour = _COLOURS[p % len(_COLOURS)]
        out += [Line(10, y - 4, 34, y - 4, colour, 3), Text(42, y, f"path {path_name(p)}: devices " + " -> ".join("+".join(map(str, group)) for group in stops))]
        y += 22
    return Scene(width, height, tuple(out))


def _n(v: float) -> str:
    return f"{round(v, 1):g}"


def _svg_text(t: Text) -> str:
    attrs = "".join(f' {k}="{v}"' for k, v, default in (("text-anchor", t.anchor, "start"), ("fill", t.colour, "black"),
                    ("font-size", _n(t.size), "13"), ("font-weight", t.weight, "normal")) if v != default)
    return f'<text x="{_n(t.x)}" y="{_n(t.y)}"{attrs}>{escape(t.text)}</text>'


_SVG = {  # each shape's SVG element
    Rect: lambda r: f'<rect x="{_n(r.x)}" y="{_n(r.y)}" width="{_n(r.w)}" height="{_n(r.h)}"' + (f' rx="{_n(r.radius)}"' if r.radius else "")
    + f' fill="{r.fill}"' + (f' stroke="{r.stroke}"' if r.stroke else "") + "/>",
    Polyline: lambda p: f'<polyline points="{" ".join(f"{_n(x)},{_n(y)}" for x, y in p.points)}" fill="none" stroke="{p.colour}" '
    f'stroke-width="{_n(p.width)}"' + (f' opacity="{p.opacity}"' if p.opacity != 1 else "") + "/>",
    Circle: lambda c: f'<circle cx="{_n(c.x)}" cy="{_n(c.y)}" r="{_n(c.r)}" fill="{c.fill}"/>',
    Line: lambda li: f'<line x1="{_n(li.x1)}" y1="{_n(li.y1)}" x2="{_n(li.x2)}" y2="{_n(li.y2)}" stroke="{li.colour}" stroke-width="{_n(li.width)}"/>',
    Text: _svg_text,
}


def draw_svg(plan: Mapping, bytes_per_device: Mapping[int, int] | None = None, title: str = "") -> str:
    """The plan's :func:`scene` as an SVG document."""
    sc = scene(plan, bytes_per_device, title)
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{sc.width}" height="{sc.height}" font-family="sans-serif" font-size="13">',
                      *(_SVG[type(item)](item) for item in sc.items), "</svg>"])


def _pillow():
    """Pillow's Image, ImageDraw and ImageFont, or an ImportError that says how to install them."""
    try:
        import PIL
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as e:
        raise ImportError(f"writing a PNG needs Pillow ({e.name or 'PIL'} is missing): pip install 'sharktank[draw]'", name="PIL") from None
    if tuple(int(x) for x in PIL.__version__.split(".")[:2]) < (10, 1):  # load_default(size=) is scalable from 10.1
        raise ImportError(f"writing a PNG needs Pillow >= 10.1, not {PIL.__version__}: pip install 'sharktank[draw]'", name="PIL")
    return Image, ImageDraw, ImageFont


def draw_png(plan: Mapping, bytes_per_device: Mapping[int, int] | None = None, title: str = "", scale: int = 2) -> bytes:
    """The plan's :func:`scene` as a PNG file's bytes, ``scale`` pixels per SVG unit."""
    Image, ImageDraw, ImageFont = _pillow()
    sc = scene(plan, bytes_per_device, title)
    image = Image.new("RGB", (sc.width * scale, sc.height * scale), "white")
    draw = ImageDraw.Draw(image)
    fonts: dict = {}
    k = lambda *v: [c * scale for c in v]  # noqa: E731
    for item in sc.items:
        if isinstance(item, Rect):
            draw.rounded_rectangle(k(item.x, item.y, item.x + item.w, item.y + item.h), item.radius * scale, item.fill, item.stroke, scale)
        elif isinstance(item, Polyline):  # painted through a mask, so what lies below shows at 1 - opacity
            mask = Image.new("L", image.size, 0)
            ImageDraw.Draw(mask).line([tuple(k(*pt)) for pt in item.points], round(255 * item.opacity), round(item.width * scale), joint="curve")
            image.paste(item.colour, (0, 0, *image.size), mask)
        elif isinstance(item, Circle):
            draw.ellipse(k(item.x - item.r, item.y - item.r, item.x + item.r, item.y + item.r), item.fill)
        elif isinstance(item, Line):
            draw.line(k(item.x1, item.y1, item.x2, item.y2), item.colour, round(item.width * scale))
        else:
            font = fonts.get(item.size) or fonts.setdefault(item.size, ImageFont.load_default(size=item.size * scale))
            bold = max(1, scale // 2) if item.weight == "bold" else 0  # the default font has no bold face: thicken its strokes
            draw.text(k(item.x, item.y), item.text, item.colour, font, anchor="ls" if item.anchor == "start" else "ms", stroke_width=bold, stroke_fill=item.colour)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()
