"""The real SmolLM2 file exported, compiled (llvm-cpu) and run with the IREE runtime, against
transformers' load of the same file (see test_real_model.py for the tolerance's reasoning:
both sides are float32 over the same dequantized values; compiled products add their own
summation order, measured ~1e-4 on logits up to ~35)."""

from __future__ import annotations

import pytest
import torch

from test_real_model import PROMPTS, prompt_ids, reference  # noqa: F401  (module fixtures)

ATOL = 2e-3


@pytest.fixture(scope="module")
def artifact(smollm2_gguf, tmp_path_factory):
    """The file exported at tp 1 (the whole 30-layer model, tokenizer included)."""
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    out = tmp_path_factory.mktemp("smollm2") / "tp1"
    export_artifact(load_model(smollm2_gguf, deferred=True), out, source=str(smollm2_gguf), max_seq_len=160)
    return out


@pytest.fixture(scope="module")
def compiled(artifact):
    from sharktank.runtime import CompiledModel

    return CompiledModel(artifact)


def test_compiled_logits_equal_transformers(compiled, reference, prompt_ids):
    model, _ = reference
    for ids in prompt_ids:
        with torch.no_grad():
            want = model(ids).logits
        got, _ = compiled.prefill(ids)
        got = torch.as_tensor(got).float()
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < ATOL
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_compiled_greedy_continuation_equals_transformers(compiled, reference, prompt_ids):
    model, _ = reference
    ids = prompt_ids[0]
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    got, _ = compiled.generate(ids, 32)
    assert torch.as_tensor(got).tolist() == want[:, ids.shape[1]:].tolist()
