"""Misusing a compiled artifact through the Python API: each misuse is one clear error
(``InputError``, raised before the module runs; a cache of wrongly shaped arrays gets the
runtime's own shape check), and the same ``CompiledModel`` keeps working afterwards.

Before these checks, a negative position reached the module, which wrote outside its KV cache:
position -1 corrupted the runtime's heap (later calls failed with PERMISSION_DENIED on a
garbage memory type) and -1000000 was a segfault.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from sharktank.models import load_model
from sharktank.runtime import ArtifactError, CompiledModel, InputError

PROMPT = torch.tensor([[5, 17, 42, 3, 9, 60, 1, 33]])
VOCAB = 256


@pytest.fixture(scope="module")
def eager_ids():
    return load_model("toy-llama").generate(PROMPT, 6)


def _decode(m: CompiledModel, tokens, positions, cache=None):
    if cache is None:
        _, cache = m.prefill(PROMPT)
    return m.decode(tokens, cache, positions)


def _cache_len(m):
    return m.find("decode", 1).max_seq_len


MISUSE = [
    ("tokens int32", lambda m: m.generate(PROMPT.int(), 2), InputError, "tokens must be int64 [B, S]"),
    ("tokens float32", lambda m: m.generate(PROMPT.float(), 2), InputError, "tokens must be int64 [B, S]"),
    ("tokens 1-D", lambda m: m.generate(PROMPT[0], 2), InputError, "tokens must be int64 [B, S]"),
    ("tokens 3-D", lambda m: m.prefill(PROMPT[None]), InputError, "tokens must be int64 [B, S]"),
    ("tokens a list", lambda m: m.prefill([[1, 2]]), InputError, "tokens must be int64 [B, S]"),
    ("empty prompt [1, 0]", lambda m: m.generate(PROMPT[:, :0], 2), InputError, "B, S >= 1"),
    ("token id -1", lambda m: m.generate(torch.tensor([[1, -1, 3]]), 2), InputError, "token ids must be in [0, 256)"),
    ("token id = vocab size", lambda m: m.generate(torch.tensor([[1, VOCAB]]), 2), InputError, "token ids must be in [0, 256)"),
    ("token id 2**40", lambda m: m.prefill(torch.tensor([[2**40]])), InputError, "token ids must be in [0, 256)"),
    ("prompt longer than the cache", lambda m: m.prefill(torch.ones(1, _cache_len(m) + 1, dtype=torch.int64)), InputError,
     "past the exported cache length"),
    ("generation running past the cache", lambda m: m.generate(PROMPT, _cache_len(m)), InputError, "past the exported cache length"),
    ("batch size 2 (only 1 exported)", lambda m: m.generate(PROMPT.expand(2, -1).contiguous(), 2), InputError,
     "no prefill function for batch size 2; exported batch sizes: [1]"),
    ("max_new_tokens -1", lambda m: m.generate(PROMPT, -1), InputError, "max_new_tokens must be >= 0"),
    ("decode at position -1", lambda m: _decode(m, torch.tensor([5]), torch.tensor([-1])), InputError, "positions must be >= 0"),
    ("decode at position -1000000", lambda m: _decode(m, torch.tensor([5]), torch.tensor([-10**6])), InputError, "positions must be >= 0"),
    ("decode at the cache length", lambda m: _decode(m, torch.tensor([5]), torch.tensor([_cache_len(m)])), InputError,
     "past the exported cache length"),
    ("decode: 1 token, 2 positions", lambda m: _decode(m, torch.tensor([5]), torch.tensor([8, 9])), InputError,
     "one token and one position per sequence"),
    ("decode with a cache one array short", lambda m: _decode(m, torch.tensor([5]), torch.tensor([8]), m.new_cache(1)[:-1]),
     InputError, "takes a cache of 8 arrays"),
    ("decode with no cache", lambda m: _decode(m, torch.tensor([5]), torch.tensor([8]), []), InputError, "takes a cache of 8 arrays"),
    ("decode with numpy arrays of the wrong shape as cache",
     lambda m: _decode(m, torch.tensor([5]), torch.tensor([8]), [np.zeros(3, np.float32)] * 8), ValueError, "tensor shape rank mismatch"),
    ("prefill with explicit positions of another shape", lambda m: m.forward("prefill", PROMPT, torch.arange(4)[None], m.new_cache(1)),
     InputError, "positions must be int64 of the tokens' shape"),
    ("prefill at an offset (positions past the prompt's length)",
     lambda m: m.forward("prefill", PROMPT, torch.arange(4, 4 + PROMPT.shape[1])[None], m.new_cache(1)), InputError,
     "prefills a prompt from position 0: positions must be below its length"),
    ("a function kind the artifact lacks", lambda m: m.forward("train", PROMPT, torch.arange(8)[None], m.new_cache(1)), InputError,
     "no train function"),
]


def test_each_misuse_is_one_clear_error_and_the_model_keeps_working(toy_artifact, eager_ids, figure):
    m = CompiledModel(toy_artifact)
    ids, _ = m.generate(PROMPT, 6)
    assert torch.equal(ids, eager_ids)
    for case, call, error, pattern in MISUSE:
        with pytest.raises(error, match=re.escape(pattern)) as err:
            call(m)
        msg = str(err.value).splitlines()[0]
        figure("bad input", f"runtime: {case}: {type(err.value).__name__}: {msg[:140]}")
    # The same object, after every error above: the same tokens as eager torch.
    ids, logits = m.generate(PROMPT, 6)
    assert torch.equal(ids, eager_ids) and logits.shape == (1, 6, VOCAB)
    ids, logits = m.generate(PROMPT, 0)  # eager returns no ids for 0 steps; so does the module
    assert ids.shape == (1, 0) and logits.shape == (1, 0, VOCAB)
    assert torch.equal(m.generate(PROMPT, 6)[0], eager_ids)


def _variant(src, tmp_path, edit):
    d = tmp_path / "variant"
    shutil.copytree(src, d)
    manifest = json.loads((d / "manifest.json").read_text())
    edit(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def _expected_reason(driver: str, devices: int) -> tuple[str, ...]:
    """What this machine must say, from asking the IREE runtime about the driver directly."""
    import iree.runtime as rt

    try:
        found = len(rt.get_driver(driver).query_available_devices())
    except Exception:
        return (f"needs {devices} {driver} devices; the {driver} driver is unavailable",)
    if found < devices:
        return (f"needs {devices} {driver} devices, found {found}",)
    # Enough devices: the CPU module's own device check (its text is in model.vmfb) refuses them.
    return "the module does not load with its parameters: ", "HAL device `__device_0` not found or unavailable"


@pytest.mark.parametrize("driver", ["cuda", "hip"])
@pytest.mark.parametrize("devices", [1, 64])
def test_gpu_driver_or_devices_missing_is_a_clear_error(toy_artifact, tmp_path, driver, devices, eager_ids, figure):
    """A manifest asking for devices this machine lacks. On a CPU-only machine the driver itself
    is missing; where the driver exists, 64 devices are more than any machine here has."""
    d = _variant(toy_artifact, tmp_path, lambda m: (m["compile"].update(driver=driver, target=driver), m.update(device_count=devices)))
    with pytest.raises(ArtifactError) as err:
        CompiledModel(d)
    msg = str(err.value)
    assert str(d) in msg and "\n" not in msg
    assert all(part in msg for part in _expected_reason(driver, devices)), msg
    figure("bad input", f"runtime: manifest driver {driver}, {devices} devices: ArtifactError: {msg.replace(str(d), 'DIR')[:150]}")
    # The process is still fine: the real artifact loads and runs.
    assert torch.equal(CompiledModel(toy_artifact).generate(PROMPT, 6)[0], eager_ids)


def test_more_cpu_devices_than_the_module_uses_still_runs(toy_artifact, tmp_path, eager_ids):
    # local-task devices are created on demand: an extra one is harmless (documented, not an error).
    d = _variant(toy_artifact, tmp_path, lambda m: m.update(device_count=2))
    assert torch.equal(CompiledModel(d).generate(PROMPT, 6)[0], eager_ids)
