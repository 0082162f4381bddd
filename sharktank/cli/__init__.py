"""The ``sharktank`` command line: export, compile, run, inspect, serve, perplexity, quantize.

One module per subcommand (each declares its options in ``add_parser`` and imports what it
runs only when it runs), what they share in :mod:`.common`. ``main`` declares the options of
the one subcommand it runs and only the name and one-line help of the others, so
``sharktank --help`` and ``sharktank inspect`` import neither torch nor IREE.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import compile, export, inspect, perplexity, quantize, run, serve
from .common import CliError

__all__ = ["CliError", "build_parser", "main"]

COMMANDS = (export, compile, run, serve, inspect, perplexity, quantize)  # in --help's order


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or (``only``) with the options of that one alone.

    The other subcommands are then declared by name and help line only: declaring a command's
    options imports what their help texts and choices come from (the models, the runtime).
    """
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
        if only is None or command.NAME == only:
            command.add_parser(sub)
        else:
            sub.add_parser(command.NAME, help=command.HELP, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {command.NAME for command in COMMANDS}
    # The subcommand is the first word (the top level has only --help and --version before it).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=chosen if chosen in names else "")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"sharktank {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code = _report(args.command, e)
        if code is None:
            raise  # a bug: it keeps its traceback
        return code


def _report(command: str, e: Exception) -> int | None:
    """Print ``e`` as one line and return the exit code, or None when it is not the user's error.

    The error classes are imported here, after the failure, so that a command that needs
    neither torch nor IREE (``inspect``) does not import them to be ready for one.
    """
    from ..export.cache_size import CacheSizeError
    from ..export.manifest import ArtifactError
    from ..parallel.plan import PlanError
    from ..runtime.compiled import InputError
    from ..runtime.distributed import DistributedError
    from ..text import TokenizerError
    from ..weights.errors import WeightsError

    user_errors = (CliError, ArtifactError, InputError, WeightsError, PlanError, CacheSizeError, TokenizerError, FileExistsError)
    if isinstance(e, user_errors):
        print(f"sharktank {command}: error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, DistributedError):
        # Another rank failed, hung or never joined: one line naming it, exit 3.
        print(f"sharktank {command}: error: {e}", file=sys.stderr, flush=True)
        return 3
    if type(e).__name__ == "CompilerToolError":
        # A compiler rejection (bad --compile-flag, unsupported target) is the user's input: one line.
        lines = str(e).splitlines() or [""]
        first = next((line for line in lines if "error:" in line or "Unknown" in line), lines[0])
        print(f"sharktank {command}: error: iree-compile failed: {first.strip()}", file=sys.stderr)
        return 2
    return None
