"""The real trained SmolLM2-135M-Instruct (GGUF as llama.cpp writes it: Q4_1, a Q8_0 tied
embedding, 9 heads / 3 KV heads) against transformers' own load of the same file.

transformers dequantizes the file with the gguf package and runs its LlamaForCausalLM in
float32; we keep the blocks and dequantize inside each product. Both sides compute in
float32 from the same values, so the logits differ by summation order only: over 30 layers
that is ~5e-5 of logits up to ~35 (measured); the bound below is 1e-3.
"""

from __future__ import annotations

import pytest
import torch

ATOL = 1e-3
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


def test_greedy_continuations_equal_transformers_for_32_tokens(ours, reference, prompt_ids):
    model, _ = reference
    for ids in prompt_ids[1:2]:
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = ours.generate(ids, 32)
        assert got.tolist() == want[:, ids.shape[1]:].tolist()


def test_tensor_parallel_3_equals_1(smollm2_gguf, ours, prompt_ids):
    # 9 heads and 3 KV heads: one KV head per device; the FFN (1536) in 3 x 16 Q4_1 blocks of inputs.
    from sharktank.models import load_model

    tp3 = load_model(smollm2_gguf, tp=3)
    ids = prompt_ids[1]
    want = ours.prefill(ids)
    got = tp3.prefill(ids)
    assert (got - want).abs().max().item() < 1e-4
    assert tp3.generate(ids, 4).tolist() == ours.generate(ids, 4).tolist()
