"""The real SmolLM2-135M-Instruct GGUF (model gpt2, pre smollm) against SmolLM2's own tokenizer:
its published pre_tokenizer (Digits one by one, then GPT-2's byte-level split) over the vocabulary
and merges read from the file. (transformers' GGUF conversion is no oracle: it ignores
tokenizer.ggml.pre.) The file comes from the ``smollm2_gguf`` fixture, which fails without it."""

from __future__ import annotations

import json

import pytest

from hard_strings import HARD
from sharktank.text import tokenizer_from_gguf

# HuggingFaceTB/SmolLM2-135M-Instruct tokenizer.json: "normalizer": null and this "pre_tokenizer".
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
CHAT = ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n 12 fox<|im_end|>\n", "<|endoftext|>x<repo_name>y"]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """(ours, SmolLM2's tokenizer rebuilt from the file's vocabulary with its published pre-tokenizer)."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    fields = GGUFReader(str(smollm2_gguf)).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
             for i, (t, k) in enumerate(zip(tokens, types)) if k == 3]
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
             "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": {t: i for i, t in enumerate(tokens)},
             "merges": fields["tokenizer.ggml.merges"].contents()}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": SMOLLM2_PRE_TOKENIZER, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}, "model": model}
    return tokenizer_from_gguf(smollm2_gguf), Tokenizer.from_str(json.dumps(spec))


def test_encodes_as_smollm2s_own_tokenizer(smollm2):
    ours, ref = smollm2
    for text in HARD + CHAT:
        ids = ours.encode(text)  # the file says add_bos_token false: nothing is added
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.encode("a 1234567") == ref.encode("a 1234567").ids and len(ours.encode("1234567")) == 7  # digits one by one


def test_round_trips_the_hard_strings(smollm2):
    ours, _ = smollm2
    for text in HARD:
        assert ours.decode(ours.encode(text)) == text


def test_special_ids_and_chat_template_are_read(smollm2):
    ours, _ = smollm2
    assert ours.vocab_size == 49152 and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    assert ours.tokenizer.id_to_token(1) == "<|im_start|>" and ours.tokenizer.id_to_token(2) == "<|im_end|>"
    prompt = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>" in ours.chat_template and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ours.encode("<|im_start|>user")[0] == 1
