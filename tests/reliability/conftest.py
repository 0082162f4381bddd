"""Reliability suite fixtures: one compiled toy artifact per test run (shared by the xdist
workers through a file lock) and a terminal summary of the figures the tests measured
(fuzz counts, RSS, kill outcomes; with -v also the table of bad inputs and their errors)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reltools import build_once, build_toy, shared_dir  # noqa: E402

# 8 prompt tokens + 64 decode steps fit; the soak builds its own 1040-long one.
TOY_MAX_SEQ_LEN = 80


@pytest.fixture(scope="session")
def toy_artifact(tmp_path_factory):
    """Compiled toy-llama, tp=1, batch 1, KV cache of TOY_MAX_SEQ_LEN. Treat it as read-only:
    tests that damage an artifact work on a copy."""
    return build_once(shared_dir(tmp_path_factory), "toy", lambda out: build_toy(out, TOY_MAX_SEQ_LEN))


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: long reliability runs, skipped unless SHARKTANK_SOAK=1 (python tools/soak.py)")


def report(record_property, key: str, value) -> None:
    """Keep a figure for the terminal summary (user properties travel back from xdist workers)."""
    record_property(f"reliability:{key}", value)


@pytest.fixture
def figure(record_property):
    return lambda key, value: report(record_property, key, value)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines, table, totals = [], [], {}
    for rep in terminalreporter.stats.get("passed", []):
        for key, value in getattr(rep, "user_properties", []):
            if not str(key).startswith("reliability:"):
                continue
            key = key.removeprefix("reliability:")
            if key == "bad input":
                table.append(value)
            elif isinstance(value, dict):  # counts from several tests: summed
                for k, v in value.items():
                    totals.setdefault(key, {}).setdefault(k, 0)
                    totals[key][k] += v
            else:
                lines.append(f"{key}: {value}")
    lines += [f"{key}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) for key, counts in totals.items()]
    if not lines and not table:
        return
    terminalreporter.section("reliability figures")
    for line in sorted(lines):
        terminalreporter.write_line(line)
    if table:
        terminalreporter.write_line(f"bad-input cases: {len(table)} (-v lists each with the error it got)")
        if config.getoption("verbose") > 0:
            for row in sorted(table):
                terminalreporter.write_line(f"  {row}")
