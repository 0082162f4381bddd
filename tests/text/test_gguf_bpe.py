"""Byte-level BPE GGUF tokenizers against each model's own published tokenizer.json.

The oracle of each ``tokenizer.ggml.pre`` name is the ``normalizer``/``pre_tokenizer`` (and the BPE
model's ``ignore_merges``) that model's tokenizer.json declares, written here as JSON data and run
by the tokenizers library; ours is built from a GGUF written here, through the name."""

from __future__ import annotations

import json
import unicodedata
from functools import lru_cache

import pytest

from hard_strings import HARD
from sharktank.text import tokenizer_from_gguf
from sharktank.text._gguf import UnsupportedTokenizer
from sharktank.text.pretokenizers import PRETOKENIZATIONS

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
BYTES_ONLY = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
NFC = {"type": "NFC"}
CL100K = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BLOOM = r" ?[^(\s|[.,!?…。，、।۔،])]+"
DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿]+"
DEEPSEEK_LETTERS = (  # escaped: U+1FDB, U+212A... must not be normalized away
    "\\s?["
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
    "]+"
)


def split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def seq(*steps: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


DIGITS_THEN_BYTE_LEVEL = seq({"type": "Digits", "individual_digits": True}, BYTE_LEVEL)
# name -> (normalizer, pre_tokenizer, ignore_merges) as the named model's tokenizer.json has them.
ORACLE = {
    "default": (None, BYTE_LEVEL, False),
    "gpt2": (None, BYTE_LEVEL, False),
    "gpt-2": (None, BYTE_LEVEL, False),  # openai-community/gpt2
    "phi-2": (None, BYTE_LEVEL, False),  # microsoft/phi-2 (CodeGen's tokenizer)
    "mpt": (NFC, BYTE_LEVEL, False),  # mosaicml/mpt-7b: EleutherAI/gpt-neox-20b's tokenizer
    "smollm": (None, DIGITS_THEN_BYTE_LEVEL, False),  # HuggingFaceTB/SmolLM-135M, SmolLM2
    "starcoder": (None, DIGITS_THEN_BYTE_LEVEL, False),  # bigcode/starcoder2-3b
    "command-r": (NFC, DIGITS_THEN_BYTE_LEVEL, False),  # CohereForAI/c4ai-command-r-v01
    "llama-bpe": (None, seq(split(CL100K), BYTES_ONLY), True),  # meta-llama/Meta-Llama-3-8B
    "dbrx": (None, seq(split(CL100K), BYTES_ONLY), False),  # databricks/dbrx-base
    "smaug-bpe": (None, seq(split(CL100K), BYTES_ONLY), False),  # abacusai/Smaug-Llama-3-70B-Instruct
    "qwen2": (NFC, seq(split(QWEN), dict(BYTES_ONLY, trim_offsets=False)), False),  # Qwen/Qwen1.5-7B
    "stablelm2": (None, seq(split(QWEN), BYTES_ONLY), False),  # stabilityai/stablelm-2-zephyr-1_6b
    "tekken": (None, seq(split(TEKKEN), BYTES_ONLY), True),  # mistralai/Mistral-Nemo-Base-2407
    "bloom": (None, seq(split(BLOOM), BYTES_ONLY), False),  # bigscience/bloom
    "poro-chat": (None, seq(split(BLOOM), BYTES_ONLY), False),  # LumiOpen/Poro-34B-chat
    "gpt3-finnish": (None, seq(split(BLOOM), BYTES_ONLY), False),  # TurkuNLP/gpt3-finnish-small
    "viking": (None, seq(split(BLOOM), {"type": "Digits", "individual_digits": True}, BYTES_ONLY), False),  # LumiOpen/Viking-7B
    "falcon": (None, seq(  # tiiuae/falcon-7b
        {"type": "Punctuation", "behavior": "Contiguous"}, BYTE_LEVEL, {"type": "Digits", "individual_digits": False},
        split("[0-9][0-9][0-9]"),
    ), False),
    "deepseek-llm": (None, seq(  # deepseek-ai/deepseek-llm-7b-base
        split("[\r\n]"), split(DEEPSEEK_LETTERS), split("\\s?[!-/:-~！-／：-～‘-‟　-。]+"), split("\\s+$"), split(DEEPSEEK_CJK),
        {"type": "Digits", "individual_digits": False}, BYTES_ONLY,
    ), False),
    "deepseek-coder": (None, seq(  # deepseek-ai/deepseek-coder-6.7b-base
        split("[\r\n]"), split("\\s?\\p{L}+"), split("\\s?\\p{P}+"), split(DEEPSEEK_CJK),
        {"type": "Digits", "individual_digits": True}, BYTES_ONLY,
    ), False),
}
SPECIAL = "<|endoftext|>"
WORD = "Ġxylophone"  # in the vocabulary, but no merges make it: only ignore_merges finds it


def tokenizer_json(normalizer, pre_tokenizer, *, ignore_merges=False, vocab=None, merges=()) -> str:
    """A minimal tokenizer.json around a normalizer and pre-tokenizer (a BPE model over ``vocab``)."""
    vocab = vocab or {}
    added = [{"id": vocab[SPECIAL], "content": SPECIAL, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}] if SPECIAL in vocab else []
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
             "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges, "vocab": vocab, "merges": [list(m) for m in merges]}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
                       "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": dict(BYTE_LEVEL), "model": model})


@lru_cache(maxsize=1)
def trained() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """A byte-level vocabulary whose merges cross every split boundary (trained on unsplit text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=[SPECIAL], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([s for s in HARD if "xylophone" not in s] * 4, trainer)
    spec = json.loads(tok.to_str())
    vocab = dict(spec["model"]["vocab"])
    assert WORD not in vocab
    vocab[WORD] = len(vocab)
    return vocab, tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"])


def oracle(name: str):
    from tokenizers import Tokenizer

    normalizer, pre, ignore = ORACLE[name]
    vocab, merges = trained()
    return Tokenizer.from_str(tokenizer_json(normalizer, pre, ignore_merges=ignore, vocab=vocab, merges=merges))


def write_gguf(path, pre: str, *, extra=lambda w: None) -> None:
    """A GGUF holding only a byte-level BPE tokenizer, as llama.cpp's converter writes one."""
    from gguf import GGUFWriter

    vocab, merges = trained()
    tokens = sorted(vocab, key=vocab.get)
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_token_types([3 if t == SPECIAL else 1 for t in tokens])
    extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_supported_name_has_an_oracle():
    assert set(PRETOKENIZATIONS) == set(ORACLE)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_splits_match_the_models_pre_tokenizer(name):
    from tokenizers import Tokenizer

    normalizer, pre, _ = ORACLE[name]
    ref = Tokenizer.from_str(tokenizer_json(normalizer, pre))
    ours = PRETOKENIZATIONS[name]
    for text in HARD:
        normalized = ours.normalizer().normalize_str(text) if ours.normalizer() else text
        want = ref.normalizer.normalize_str(text) if ref.normalizer else text
        assert normalized == want, (name, text)
        assert ours.pre_tokenizer().pre_tokenize_str(normalized) == ref.pre_tokenizer.pre_tokenize_str(want), (name, text)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_gguf_encodes_as_the_model_would(tmp_path, name):
    write_gguf(tmp_path / "t.gguf", name)
    tok, ref = tokenizer_from_gguf(tmp_path / "t.gguf"), oracle(name)
    nfc = ORACLE[name][0] is not None
    for text in HARD + [f"a{SPECIAL}b {SPECIAL}"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, (name, text)
        assert tok.decode(ids) == (unicodedata.normalize("NFC", text) if nfc else text).replace(SPECIAL, "")
    # ignore_merges: the unmergeable word comes whole only where the model's tokenizer.json says so.
    assert (tok.encode(" xylophone", add_special_tokens=False) == [trained()[0][WORD]]) == ORACLE[name][2]


def test_the_names_split_differently():
    """Each oracle is discriminating: encodes differ from GPT-2's unless the model's JSON is GPT-2's."""
    encodes = {name: [oracle(name).encode(t).ids for t in HARD] for name in ORACLE}
    for name in ORACLE:
        same = ORACLE[name] == ORACLE["gpt2"]
        assert (encodes[name] == encodes["gpt2"]) == same, name


def test_control_tokens_bos_eos_eot_and_eom(tmp_path):
    vocab, _ = trained()

    def extra(w):
        w.add_bos_token_id(vocab[SPECIAL])
        w.add_eos_token_id(vocab[SPECIAL])
        w.add_eot_token_id(vocab["a"])
        w.add_eom_token_id(vocab["b"])
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)

    write_gguf(tmp_path / "t.gguf", "llama-bpe", extra=extra)
    tok, ref = tokenizer_from_gguf(tmp_path / "t.gguf"), oracle("llama-bpe")
    e = vocab[SPECIAL]
    assert tok.bos_token_id == e and tok.eos_token_ids == (e, vocab["a"], vocab["b"])
    plain = lambda s: ref.encode(s, add_special_tokens=False).ids
    assert tok.encode(f"hi {SPECIAL}there") == [e] + plain("hi ") + [e] + plain("there") + [e]
    assert tok.encode("", add_special_tokens=False) == [] and tok.encode("") == [e, e]
    assert tok.decode(tok.encode(f"hi {SPECIAL}there")) == "hi there"


def test_user_defined_tokens_are_matched_whole_and_decoded(tmp_path):
    from gguf import GGUFWriter

    vocab, merges = trained()
    tokens = sorted(vocab, key=vocab.get) + ["<tool>"]
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_token_types([3 if t == SPECIAL else 4 if t == "<tool>" else 1 for t in tokens])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok, ref = tokenizer_from_gguf(tmp_path / "t.gguf"), oracle("qwen2")
    plain = lambda s: ref.encode(s, add_special_tokens=False).ids
    tool = len(tokens) - 1
    assert tok.encode("call <tool>(1)", add_special_tokens=False) == plain("call ") + [tool] + plain("(1)")
    assert tok.decode(tok.encode("call <tool>(1)")) == "call <tool>(1)"  # user-defined tokens are text


@pytest.mark.parametrize("pre", ["chameleon", "chatglm-bpe", "exaone", "no-such-split"])
def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path, pre):
    write_gguf(tmp_path / "t.gguf", pre)
    with pytest.raises(UnsupportedTokenizer, match=rf"pre-tokenizer '{pre}' is not supported; supported: .*deepseek-coder.*smollm"):
        tokenizer_from_gguf(tmp_path / "t.gguf")
