"""What the runtime reports about its own process."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["seconds_since_process_start"]


def seconds_since_process_start(at: float) -> float | None:
    """Seconds from this process's start to the ``time.perf_counter()`` value ``at`` (Linux:
    from /proc, to a clock tick; None elsewhere)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start - (time.perf_counter() - at)
