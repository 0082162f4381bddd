"""`sharktank inspect`: what an artifact holds, with a drawing of its placement."""

from __future__ import annotations

import json
from pathlib import Path

from .common import CliError

__all__ = ["add_parser", "cmd_inspect"]

NAME = "inspect"
HELP = "describe an exported directory (and draw its placement)"  # the line in `sharktank --help`


def cmd_inspect(args) -> int:
    from ..export.manifest import HostsManifest, parameter_bytes_per_device, read_any
    from ..parallel.drawing import draw_png, draw_svg, draw_text

    m = read_any(args.dir)
    per_device = parameter_bytes_per_device(m)
    p = m.data["parallel"]
    title = f"{Path(args.dir).resolve().name}: tp={p['tp']} pp={p['pp']}"
    pictures = {}  # file -> its bytes, all drawn before any is written
    if args.svg:
        pictures[args.svg] = draw_svg(p, per_device, title).encode()
    if args.png:
        try:
            pictures[args.png] = draw_png(p, per_device, title)
        except ImportError as e:  # Pillow missing or too old: the message says what to install
            raise CliError(f"--png: {e}") from None
    if pictures:
        from ..weights._files import atomic_file

        for file, data in pictures.items():
            with atomic_file(file) as tmp:
                Path(tmp).write_bytes(data)
    if isinstance(m, HostsManifest):
        info = {
            "model": m.data["model"]["source"], "dtype": m.dtype, "tp": p["tp"], "pp": p["pp"], "hosts": len(m.hosts),
            "parameter_bytes_per_device": {str(d): b for d, b in sorted(per_device.items())},
            "host_dirs": [h.dir for h in m.hosts],
        }
        if args.json:
            print(json.dumps(info))
            return 0
        print(f"{info['model']} ({info['dtype']}), tp={info['tp']} pp={info['pp']}, over {info['hosts']} hosts ({', '.join(info['host_dirs'])}: inspect each for its program)")
        print(draw_text(p, per_device))
        return 0
    info = {
        "model": m.source,
        "dtype": m.dtype,
        "tp": p["tp"],
        "pp": p["pp"],
        "device_count": m.device_count,
        "stages": [{"stage": s, "blocks": [b for b, x in enumerate(p["stage_of_block"]) if x == s], "devices": reps} for s, reps in enumerate(p["replicas"])],
        "paths": p["paths"],
        "parameter_bytes_per_device": {str(d): b for d, b in per_device.items()},
        "transfers": m.transfers,
        "functions": sorted(m.functions),
        "compile": m.compile,
        "versions": m.versions,
        "tokenizer": m.tokenizer,
        "experts": m.experts,
        "dense": m.dense if m.experts else None,
        "kv_cache": _kv_cache(m),
    }
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{info['model']} ({info['dtype']}), {info['device_count']} devices")
    print(draw_text(p, per_device))
    c = m.config
    if c.get("num_experts"):
        if m.experts == "experts" and m.dense == "replicated":
            split = "whole experts per device (expert parallelism alone: every other weight and the KV cache replicated on each device)"
        elif m.experts == "experts":
            split = "whole experts per device over each tensor-parallel group"
        else:
            split = "each expert split as the dense FFN"
        print(f"experts: {c['num_experts']} per block, {c['num_experts_per_tok']} per token; {split}")
    kv = info["kv_cache"]
    paged = f"; paged: pages of {kv['page_size']} positions, up to {kv['max_pages']} per sequence" if kv["page_size"] else ""
    print(f"kv cache: {kv['max_seq_len']} positions per batch row{paged}")
    print("transfers per function:", ", ".join(f"{k}: {v}" for k, v in info["transfers"].items()))
    tok = info["tokenizer"]
    print("tokenizer:", "none (token ids only)" if tok is None else tok["kind"] + (f" {tok['file']}, EOS ids {tok['eos_token_ids']}" if tok["kind"] == "hf" else ""))
    if m.compile:
        print(f"compiled for {m.compile['target']} in {m.compile['seconds']} s with:", " ".join(m.compile["flags"]))
    else:
        print("not compiled (run `sharktank compile`)")
    return 0


def add_parser(sub) -> None:
    """Declare `sharktank inspect` on the subcommand set ``sub``."""
    i = sub.add_parser(
        NAME, help=HELP,
        description="Draw the placement (devices as columns, pipeline stages as rows, each cell the microbatch paths "
        "A, B, ... that run that stage on that device, so a letter read down the rows is one path's route; the "
        "parameter bytes each device holds), then transfers per function, the tokenizer and the compile flags. "
        "A multi-host artifact's top directory draws the whole plan with each stage's host.",
    )
    i.add_argument("dir", help="an export directory (from `sharktank export`, one program or --hosts)")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--svg", metavar="FILE", help="also write the drawing as an SVG picture to FILE")
    i.add_argument("--png", metavar="FILE", help="also write the same drawing as a PNG image (2 pixels per SVG unit) to FILE; "
                   "needs Pillow: pip install 'sharktank[draw]'")
    i.set_defaults(func=cmd_inspect)


def _kv_cache(m) -> dict:
    """The cache the functions take: the contiguous length and, when exported, the pages."""
    paged = m.find("prefill_paged", 1)
    return {"max_seq_len": m.max_seq_len, "page_size": paged.page_size if paged else None, "max_pages": paged.max_pages if paged else None}
