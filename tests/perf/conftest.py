"""The harness helpers in tools/ (bench_mlir, bench_collectives) are importable here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
