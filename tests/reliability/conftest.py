"""Reliability suite fixtures: one compiled toy artifact per test run (shared by the xdist
workers through a file lock), the ``figure`` fixture that keeps a measured figure, and the
terminal section that prints them (summary.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reltools import build_once, build_toy, shared_dir  # noqa: E402
from summary import pytest_terminal_summary  # noqa: E402,F401  (the figures section)

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
