"""Fixtures of the engine tests: the compiled engine artifact and started engines."""

from __future__ import annotations

import pytest
from engine_artifact import engine_artifact

from sharktank.runtime import CompiledModel
from sharktank.serving.engine import Engine


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    return CompiledModel(engine_artifact(tmp_path_factory), driver="local-sync")


@pytest.fixture
def engines(compiled):
    """Engines made by ``make(**kwargs)``, started, and stopped (thread joined) at the end; the
    contiguous cache unless ``paged`` says otherwise (test_engine_paged.py tests the pool)."""
    made = []

    def make(model=compiled, start=True, paged=False, **kwargs):
        e = Engine(model, paged=paged, **kwargs)
        made.append(e)
        if start:
            e.start()
        return e

    yield make
    for e in made:
        e.stop()
    assert not any(e.running for e in made)
