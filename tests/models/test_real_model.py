"""The real trained SmolLM2-135M-Instruct (GGUF as llama.cpp writes it: Q4_1, a Q8_0 tied
embedding, 9 heads / 3 KV heads) against transformers' own load of the same file.

transformers dequantizes the file with the gguf package and runs its LlamaForCausalLM in
float32; we keep the blocks and dequantize inside each product. Both sides compute in
float32 from the same values, so the logits differ by summation order only: over 30 layers
that is ~5e-5 of logits up to ~35 (measured); the bound below is 1e-3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

ATOL = 1e-3
# Public-domain text (the Gettysburg Address, the Declaration of Independence's first two
# paragraphs, the Constitution's preamble): 657 tokens of SmolLM2's tokenizer (the file says
# add_bos_token false, so no BOS: chunks are scored as they fall, as llama-perplexity does).
TEXT = Path(__file__).parent.parent / "data" / "us_founding_texts.txt"
WINDOW = 64
# Perplexity from our logits vs from transformers': both float32 over the same values, the
# logits ~5e-5 apart; measured 2e-6 relative eager, the bound leaves room.
PPL_RTOL = 1e-4
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a prime number."}],
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969, 3 astronauts flew to the Moon. Their names were",
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """transformers' model and tokenizer of the file (float32, dequantized by gguf)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    from sharktank.models import load_model

    return load_model(smollm2_gguf)


def reference_perplexity(model, ids: list[int], window: int, bos_id: int | None) -> float:
    """llama-perplexity's number written out on transformers' logits, in float64: chunks of
    ``window`` ids from scratch (BOS first when the tokenizer adds one), the second half of
    each scored."""
    nll, count = 0.0, 0
    for c in range(len(ids) // window):
        chunk = torch.tensor(ids[c * window : (c + 1) * window])
        if bos_id is not None:
            chunk[0] = bos_id
        with torch.no_grad():
            logp = torch.log_softmax(model(chunk[None]).logits[0].double(), -1)
        for j in range(window // 2, window - 1):
            nll -= logp[j, chunk[j + 1]].item()
            count += 1
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def prompt_ids(reference):
    """Token ids of the prompts (the same ids go to both sides)."""
    _, tok = reference
    return [torch.tensor([tok.encode(p)]) for p in PROMPTS]


def test_the_file_describes_smollm2(ours):
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (49152, 100000.0, 1e-5, True)


def test_eager_logits_equal_transformers(ours, reference, prompt_ids):
    model, _ = reference
    for ids in prompt_ids:
        with torch.no_grad():
            want = model(ids).logits
            got = ours.prefill(ids)
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err < ATOL, (ids.tolist(), err)
        # A trained model's next token is far from ties: the top choice is the same everywhere.
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_continuation_equals_transformers(ours, reference, prompt_ids):
    # Eager quantized products dequantize every weight per call (~7 s a step here): 4 tokens
    # eagerly; the compiled model's 32 are in test_real_model_compiled.py.
    model, _ = reference
    ids = prompt_ids[0]
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.generate(ids, 4).tolist() == want[:, ids.shape[1]:].tolist()


def test_tensor_parallel_3_equals_1(smollm2_gguf, ours, prompt_ids):
    # 9 heads and 3 KV heads: one KV head per device; the FFN (1536) in 3 x 16 Q4_1 blocks of inputs.
    from sharktank.models import load_model

    tp3 = load_model(smollm2_gguf, tp=3)
    ids = prompt_ids[0]
    want = ours.prefill(ids)
    got = tp3.prefill(ids)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_chat_template_renders_as_transformers(smollm2_gguf, reference):
    from sharktank.text import tokenizer_from_gguf

    _, tok = reference
    ours = tokenizer_from_gguf(smollm2_gguf)
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages)
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        # The template writes <|im_start|> (BOS) itself: the prompt is encoded without special tokens.
        want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ours.encode(text, add_special_tokens=False) == list(want)


def test_perplexity_command_equals_transformers(smollm2_gguf, reference, capsys, tmp_path):
    """`sharktank perplexity FILE.gguf` (eager) against the computation written out on
    transformers' logits, over the same ids (our tokenizer's)."""
    from sharktank.cli import main
    from sharktank.text import tokenizer_from_gguf

    model, _ = reference
    # Eagerly (every product dequantizes its weight) two windows; the compiled test takes all ten.
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:700])
    ids = tokenizer_from_gguf(smollm2_gguf).encode(text.read_text(), add_special_tokens=True)
    assert ids[0] != 1 and 2 * WINDOW <= len(ids) < 3 * WINDOW  # add_bos_token false: no BOS
    capsys.readouterr()
    assert main(["perplexity", str(smollm2_gguf), "--text", str(text), "--window", str(WINDOW), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["kind"], got["bos_id"], got["tokens"], got["chunks"]) == ("eager", None, len(ids), len(ids) // WINDOW)
    assert got["tokens_scored"] == len(ids) // WINDOW * (WINDOW // 2 - 1)
    want = reference_perplexity(model, ids, WINDOW, bos_id=None)
    assert math.isclose(got["ppl"], want, rel_tol=PPL_RTOL), (got["ppl"], want)
    # A trained model reads English far better than chance (49152), and far from a broken one.
    assert 2 < want < 100
