"""`sharktank quantize`: any model source written as a quantized GGUF."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .common import CliError, say

__all__ = ["add_parser", "cmd_quantize"]

NAME = "quantize"
HELP = "write a model as a quantized GGUF"  # the line in `sharktank --help`


def cmd_quantize(args) -> int:
    from ..models.loading import weight_source
    from ..models import quantize_gguf

    out = Path(args.output)
    if out.suffix != ".gguf":
        raise CliError(f"OUTPUT must be a .gguf file, found {out}")
    if out.exists() and not args.force:
        raise CliError(f"{out} exists (--force replaces it)")
    t0 = time.perf_counter()
    config, source = weight_source(args.input)
    counts = quantize_gguf(out, config, source, to=args.to, progress=lambda m: say(args, m))
    summary = {"output": str(out), "bytes": out.stat().st_size, "tensors_by_type": counts, "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        print(f"wrote {out}: {summary['bytes'] / 1e6:.1f} MB ({kinds}) in {summary['seconds']:.1f} s")
    return 0


def add_parser(sub) -> None:
    """Declare `sharktank quantize` on the subcommand set ``sub``."""
    from ..models import SOURCES_HELP
    from ..weights import QUANTIZE_TO

    q = sub.add_parser(
        NAME, help=HELP,
        description="Quantize a model's 2-D weights with the gguf package's own quantizers and write a llama GGUF "
        "(norms and biases stay float32; weights whose rows are not whole blocks, or already quantized, are kept). "
        "Reads and writes one tensor at a time. K-quants (Q4_K, Q6_K) load but are not made here.",
    )
    q.add_argument("input", help=f"the model: {SOURCES_HELP}")
    q.add_argument("output", help="the .gguf file to write (written beside and renamed into place)")
    q.add_argument("--to", required=True, choices=sorted(QUANTIZE_TO), help="the quantization")
    q.add_argument("--force", action="store_true", help="replace an existing OUTPUT")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=cmd_quantize)
