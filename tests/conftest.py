"""Shared test helpers: placing a torch tensor as each sharded type."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# Deterministic, CI-sized property tests; `HYPOTHESIS_PROFILE=thorough` runs more examples.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Caches the code keeps between runs (the record of verified artifact files) go to a
# directory of this test run, never the user's ~/.cache; subprocesses inherit it.
os.environ["SHARKTANK_CACHE"] = tempfile.mkdtemp(prefix="sharktank-test-cache-")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

# The reliability figures (fuzz counts, RSS, kill outcomes) print in whole-suite runs too.
from reliability.summary import pytest_terminal_summary  # noqa: E402,F401
