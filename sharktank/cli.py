"""The ``sharktank`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sharktank",
        description=(
            "Shard inference models across devices (tensor and pipeline parallelism), export them "
            "to one multi-device IREE program, compile and run them. The sharded ops are the "
            "Python API (sharktank.ops); the export, compile, run and inspect subcommands are "
            "not written yet."
        ),
    )
    parser.add_argument("--version", action="version", version=f"sharktank {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    del args
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
