"""The reliability soak: the opt-in long versions of tests/reliability.

Runs every test marked ``soak`` (skipped in CI) with SHARKTANK_SOAK=1: differential fuzzing of
the ops over many more seeded sequences, 1,000 decode steps of the compiled toy model against
eager torch with RSS sampled from /proc/self/statm, two dozen SIGKILLs of ``sharktank export``
over every phase (and of ``sharktank compile``), and an export over the debris they leave.
The figures (fuzz counts, RSS, kill outcomes) are printed at the end.

    python tools/soak.py                 # everything: 13 minutes on this 2-core machine
    python tools/soak.py --fuzz 50000    # more fuzz sequences
    python tools/soak.py -k fuzz         # only the soak tests matching a pytest -k expression
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fuzz", type=int, default=10000, help="fuzz sequences (default 10000; CI runs 800)")
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("-k", dest="keyword", help="only the soak tests matching this pytest -k expression")
    args = parser.parse_args(argv)
    env = {**os.environ, "SHARKTANK_SOAK": "1", "SHARKTANK_SOAK_FUZZ": str(args.fuzz)}
    cmd = [sys.executable, "-m", "pytest", "tests/reliability", "-m", "soak", "-q", "-p", "no:cacheprovider", "-rs"]
    if args.workers > 1:
        cmd += ["-n", str(args.workers)]
    if args.keyword:
        cmd += ["-k", args.keyword]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
