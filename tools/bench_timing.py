"""Timing for the harness: several callables timed in the same run, interleaved over
rounds, reported as medians and per-round ratios (this machine is shared and noisy)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

__all__ = ["interleaved", "ratio_stats", "side_by_side"]


def _time(fn: Callable, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def interleaved(fns: dict[str, Callable], rounds: int, inner: int) -> dict[str, list[float]]:
    """Seconds per call of each function, one figure per round; each round runs every
    function in turn, so a slow spell of the machine hits them alike."""
    for fn in fns.values():
        fn()  # warm caches
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(_time(fn, inner))
    return out


def ratio_stats(a: list[float], b: list[float]) -> dict:
    """Median of ``a`` and ``b`` and of the per-round ratios ``a/b``, with their min-max."""
    ratios = sorted(x / y for x, y in zip(a, b))
    return {
        "a_us": statistics.median(a) * 1e6,
        "b_us": statistics.median(b) * 1e6,
        "ratio": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
    }


def side_by_side(ours: Callable, plain: Callable, rounds: int, inner: int = 200) -> dict:
    """``ours`` against ``plain``: medians in microseconds and the ratio ours/plain."""
    t = interleaved({"ours": ours, "plain": plain}, rounds, inner)
    r = ratio_stats(t["ours"], t["plain"])
    return {"ours_us": r.pop("a_us"), "plain_us": r.pop("b_us"), **r}
