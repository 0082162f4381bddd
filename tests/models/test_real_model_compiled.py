"""The real SmolLM2 file exported as a user exports it (defaults), compiled (llvm-cpu) and run
with the IREE runtime, against transformers' load of the same file.

Tolerances. Both sides are float32 over the same dequantized values (test_real_model.py), but
the export's prompt products are the bfloat16 prefill dispatches (sharktank/export/kernels/
prefill.py: x and each weight tile rounded to bfloat16, 2^-9 relative each, as llama.cpp
rounds its activations to 8-bit blocks), so prompt logits carry that rounding through 30
layers: measured 0.7e-2 to 1.2e-2 of the largest |logit| (27 to 42) on these prompts, every
argmax equal. Decode steps (the int16-x kernels, error far below bfloat16's) start from the
prompt's cache. The greedy ids and the chat answer are checked exactly; perplexity within
PPL_RTOL_PROMPTS (measured 8.462 against 8.446). With --exact-prompts an export matches eager
to ~1e-4 (the tiny-model tests check that path at 1e-4)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_real_model import CONVERSATIONS, PROMPTS, TEXT, WINDOW, prompt_ids, reference, reference_perplexity  # noqa: F401  (module fixtures)

PROMPT_RTOL = 2e-2  # max |compiled - transformers| / max |logit|
PPL_RTOL_PROMPTS = 5e-3


@pytest.fixture(scope="module")
def artifact(smollm2_gguf, tmp_path_factory):
    """The file exported at tp 1 (the whole 30-layer model, tokenizer included), with the two
    functions these tests run (prefill and decode: run, generate and perplexity use no other)."""
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    out = tmp_path_factory.mktemp("smollm2") / "tp1"
    export_artifact(load_model(smollm2_gguf, deferred=True), out, source=str(smollm2_gguf), max_seq_len=160, functions=("prefill", "decode"))
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
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= PROMPT_RTOL, f"max |error| / max |logit| = {err:.3g}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_compiled_greedy_continuation_equals_transformers(compiled, reference, prompt_ids):
    model, _ = reference
    ids = prompt_ids[0]
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    got, _ = compiled.generate(ids, 32)
    assert torch.as_tensor(got).tolist() == want[:, ids.shape[1]:].tolist()


def test_run_prompt_chat_answers_in_text(artifact, reference, capsys):
    """`sharktank run DIR --prompt ... --chat` on the compiled model: the answer transformers'
    greedy decoding gives for the same chat prompt, as text, stopped at <|im_end|> or at the limit."""
    from sharktank.cli import main

    model, tok = reference
    question = CONVERSATIONS[0][0]["content"]
    capsys.readouterr()
    assert main(["run", str(artifact), "--prompt", question, "--chat", "--max-new-tokens", "40", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = tok.apply_chat_template(CONVERSATIONS[0], tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert got["prompt_ids"] == ids
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64), max_new_tokens=40,
                              do_sample=False, eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
    assert got["ids"] == want
    assert got["text"] == tok.decode(want, skip_special_tokens=True)
    assert "Paris" in got["text"]  # a trained model answers; the check above is the exact one


def test_compiled_perplexity_equals_transformers(artifact, reference, capsys):
    from sharktank.cli import main

    model, _ = reference
    capsys.readouterr()
    assert main(["perplexity", str(artifact), "--text", str(TEXT), "--window", str(WINDOW), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kind"] == "compiled"
    from sharktank.text import load_tokenizer

    ids = load_tokenizer(artifact).encode(TEXT.read_text(), add_special_tokens=True)
    want = reference_perplexity(model, ids, WINDOW, bos_id=None)
    assert math.isclose(got["ppl"], want, rel_tol=PPL_RTOL_PROMPTS), (got["ppl"], want)
