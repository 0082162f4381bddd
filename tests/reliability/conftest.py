"""Reliability suite fixtures: one compiled toy artifact per test run (shared by the xdist
workers through a file lock), the ``figure`` fixture that keeps a measured figure, and the
terminal section that prints them (summary.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reltools import shared_toy  # noqa: E402
from summary import pytest_terminal_summary  # noqa: E402,F401  (the figures section)


@pytest.fixture(scope="session")
def toy_artifact(tmp_path_factory):
    """Compiled toy-llama, tp=1, batch 1, KV cache of TOY_MAX_SEQ_LEN (reltools.shared_toy).
    Treat it as read-only: tests that damage an artifact work on a copy."""
    return shared_toy(tmp_path_factory)


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: long reliability runs, skipped unless SHARKTANK_SOAK=1 (python tools/soak.py)")


def report(record_property, key: str, value) -> None:
    """Keep a figure for the terminal summary (user properties travel back from xdist workers)."""
    record_property(f"reliability:{key}", value)


@pytest.fixture
def figure(record_property):
    return lambda key, value: report(record_property, key, value)
