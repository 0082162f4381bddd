"""The ``sharktank`` command line: export, compile, run, inspect, serve, perplexity, quantize.

One module per subcommand (each declares its options in ``add_parser`` and imports what it
runs only when it runs), what they share in :mod:`.common`.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import compile, export, inspect, perplexity, quantize, run, serve
from .common import CliError

__all__ = ["CliError", "build_parser", "main"]

COMMANDS = (export, compile, run, serve, inspect, perplexity, quantize)  # in --help's order


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="sharktank",
        description=(
            "Shard inference models across devices (tensor and pipeline parallelism), export them "
            "to one multi-device IREE program, compile and run them."
        ),
    )
    parser.add_argument("--version", action="version", version=f"sharktank {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from ..export.cache_size import CacheSizeError
    from ..parallel import PlanError
    from ..runtime import ArtifactError, InputError
    from ..runtime.distributed import DistributedError
    from ..text import TokenizerError
    from ..weights import WeightsError

    try:
        return args.func(args)
    except (CliError, ArtifactError, InputError, WeightsError, PlanError, CacheSizeError, TokenizerError, FileExistsError) as e:
        # User errors: one line, exit 2. Anything else is a bug and keeps its traceback.
        print(f"sharktank {args.command}: error: {e}", file=sys.stderr)
        return 2
    except DistributedError as e:
        # Another rank failed, hung or never joined: one line naming it, exit 3.
        print(f"sharktank {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 3
    except Exception as e:
        # A compiler rejection (bad --compile-flag, unsupported target) is the user's input: one line.
        if type(e).__name__ != "CompilerToolError":
            raise
        first = next((line for line in str(e).splitlines() if "error:" in line or "Unknown" in line), str(e).splitlines()[0])
        print(f"sharktank {args.command}: error: iree-compile failed: {first.strip()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sharktank {args.command}: interrupted", file=sys.stderr)
        return 130
