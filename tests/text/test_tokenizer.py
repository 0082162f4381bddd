"""Tokenizers against references: Python's UTF-8 codec for bytes, transformers' fast
tokenizer for tokenizer.json, checkpoints and GGUF metadata; chat templates as transformers
renders them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharktank.text import ByteTokenizer, HFTokenizer, TokenizerError, tokenizer_from_gguf
from tiny import CHAT_TEMPLATE, SENTENCES, reference, tiny_bpe, write_checkpoint_tokenizer, write_gguf_stub, write_gguf_tokenizer

# Text the tiny tokenizer covers (its byte alphabet covers any text), special tokens included.
TEXTS = st.lists(st.sampled_from(list("The quick fox 日本語 éà🦊✨\n\t12!") + ["<s>", "</s>", "<|end|>"]), max_size=40).map("".join)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello, fox! "}, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "日本語?"}]


@given(st.text())
def test_bytes_round_trip_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text and all(0 <= i < tok.vocab_size for i in ids)


def test_bytes_has_no_special_tokens_or_chat_template():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.eos_token_ids == () and tok.bos_token_id is None
    assert tok.decode([0x66, 0xFF, 0x6F]) == "f\ufffdo"
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


@given(TEXTS)
def test_hf_tokenizer_encodes_and_decodes_like_transformers(text):
    tok, ref = HFTokenizer(tiny_bpe()), reference()
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_checkpoint_settings_and_chat_template_match_transformers(tmp_path):
    write_checkpoint_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok, ref = HFTokenizer.from_checkpoint(tmp_path), reference()
    assert tok.vocab_size == len(ref) == 400
    assert tok.bos_token_id == ref.bos_token_id and tok.eos_token_ids == (1, 2) and tok.chat_template == CHAT_TEMPLATE
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(MESSAGES) == want
    assert want.startswith("<s><|system|>\nBe brief.<|end|>\n") and want.endswith("<|user|>\n日本語?<|end|>\n<|assistant|>\n")
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    # Without generation_config.json the EOS comes from tokenizer_config.json's eos_token.
    (tmp_path / "generation_config.json").unlink()
    assert HFTokenizer.from_checkpoint(tmp_path).eos_token_ids == (ref.eos_token_id,)


def test_a_checkpoint_without_a_template_refuses_chat(tmp_path):
    tok = HFTokenizer(tiny_bpe())
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)
    with pytest.raises(TokenizerError, match=r"EOS/BOS ids \[400\] are outside the tokenizer's vocabulary of 400"):
        HFTokenizer(tiny_bpe(), eos_token_ids=[400])
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("add_bos", [True, False])
def test_gguf_tokenizer_encodes_and_decodes_like_the_original(tmp_path, add_bos):
    path = tmp_path / "tok.gguf"
    write_gguf_tokenizer(path, add_bos=add_bos)
    tok, ref = tokenizer_from_gguf(path), reference()
    assert tok.vocab_size == len(ref) and tok.bos_token_id == ref.bos_token_id and tok.eos_token_ids == (ref.eos_token_id,)
    samples = SENTENCES + ["<s>hi</s> <|end|>x", "  two  spaces ", "ÿ\x00\x7f", "🦊" * 5, ""]
    for text in samples:
        ids = tok.encode(text)
        want = ref.encode(text, add_special_tokens=add_bos)  # the reference adds <s> as its post-processor says
        assert ids == want, text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_gguf_without_or_with_an_unsupported_tokenizer_is_refused(tmp_path):
    from sharktank.text._gguf import UnsupportedTokenizer

    write_gguf_stub(tmp_path / "none.gguf", None)
    with pytest.raises(TokenizerError, match="no tokenizer metadata"):
        tokenizer_from_gguf(tmp_path / "none.gguf")
    write_gguf_stub(tmp_path / "ugm.gguf", "t5")
    with pytest.raises(UnsupportedTokenizer, match="model 't5' is not supported; supported: 'gpt2' .*, 'llama'"):
        tokenizer_from_gguf(tmp_path / "ugm.gguf")
    write_gguf_stub(tmp_path / "spm.gguf", "llama")
    with pytest.raises(TokenizerError, match="'llama' tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.scores; found no scores"):
        tokenizer_from_gguf(tmp_path / "spm.gguf")
    write_gguf_stub(tmp_path / "nomerges.gguf", "gpt2")
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.tokens and tokenizer.ggml.merges"):
        tokenizer_from_gguf(tmp_path / "nomerges.gguf")
