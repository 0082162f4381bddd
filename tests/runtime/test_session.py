"""Session's local-task workers: spinning for the next dispatch changes no result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharktank.export import compile_mlir, export_function
from sharktank.runtime import Session
from sharktank.runtime import session as session_module


def _chain(x, w):
    for _ in range(6):  # several dependent dispatches, the case spinning is for
        x = torch.tanh(x @ w)
    return x


@pytest.fixture(scope="module")
def program():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 64, generator=g), torch.randn(64, 64, generator=g) / 8
    return compile_mlir(str(export_function(_chain, (x, w)).mlir_module), 1), (x, w)


def test_spinning_workers_give_the_same_results(program):
    vmfb, (x, w) = program
    want = _chain(x, w).numpy()
    got = {spin: Session(vmfb, 1, worker_spin_us=spin).call("main", [x.numpy(), w.numpy()], [0, 0])[0] for spin in (0, 25, session_module.WORKER_SPIN_US)}
    for spin, y in got.items():
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=f"worker_spin_us={spin}")
    assert np.array_equal(got[0], got[25])
    # One driver (worker pool) per setting.
    assert session_module._TASK_DRIVERS[0] is not session_module._TASK_DRIVERS[25]


def test_negative_spin_is_refused(program):
    with pytest.raises(ValueError, match="worker_spin_us must be >= 0, found -1"):
        Session(program[0], 1, worker_spin_us=-1)
