"""How each model family splits text before byte-level BPE: one row per ``tokenizer.ggml.pre`` name.

llama.cpp's converter names the pre-tokenizer of a ``gpt2`` (byte-level BPE) GGUF in
``tokenizer.ggml.pre``; the split itself is not in the file. Each row here rebuilds the split the
named model's own ``tokenizer.json`` declares (its ``normalizer`` and ``pre_tokenizer``, and
``ignore_merges`` of its BPE model) from a few shared parts. A name whose tokenizer.json could not
be checked is left out, and the reader refuses it: today olmo, jais, refact, codeshell, exaone,
minerva-7b, chameleon and chatglm-bpe (llama.cpp's regexes give their splits, not their JSON).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Pretokenization", "PRETOKENIZATIONS"]


@dataclass(frozen=True)
class Pretokenization:
    """The text preparation of one model's tokenizer.json: ``steps()`` builds its pre_tokenizer."""

    model: str  # the model whose published tokenizer.json this is
    steps: Callable[[], Any]
    nfc: bool = False  # the tokenizer.json has an NFC normalizer
    ignore_merges: bool = False  # its BPE model looks a whole word up before merging
    add_bos: bool = False  # llama.cpp's default for add_bos_token when the file does not say

    def pre_tokenizer(self):
        return self.steps()

    def normalizer(self):
        from tokenizers import normalizers

        return normalizers.NFC() if self.nfc else None


# --- the regexes of the Split steps, as the tokenizer.json files write them -----------------------
# GPT-4's cl100k split (Llama 3, DBRX, Smaug): letters, digits in threes, punctuation, whitespace.
_CL100K = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen's split is cl100k with one digit per piece.
_QWEN2 = _CL100K.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's tekken: cased words, single digits, a slash may trail punctuation.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# BLOOM's split (also Poro, Viking, GPT-3 Finnish): runs of anything but space and a few stops.
_BLOOM = r" ?[^(\s|[.,!?…。，、।۔،])]+"
# DeepSeek's letter class (LLM 7B) and its CJK runs (LLM and Coder).
# (escaped: the class holds characters, e.g. U+1FDB and U+212A, that Unicode normalization would rewrite)
_DEEPSEEK_LETTERS = (
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
_DEEPSEEK_PUNCT = r"\s?[!-/:-~！-／：-～‘-‟　-。]+"
_DEEPSEEK_CJK = r"[一-龥ࠀ-一가-퟿]+"


# --- the steps ----------------------------------------------------------------------------------
def _byte_level(*, regex: bool, trim_offsets: bool = True):
    """Bytes to GPT-2's printable alphabet; ``regex`` also applies GPT-2's own split first."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=trim_offsets, use_regex=regex)


def _split(pattern: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def _digits(*, each: bool):
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Digits(individual_digits=each)


def _sequence(*steps):
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(list(steps))


def _gpt2():
    return _byte_level(regex=True)


def _digits_then_gpt2():
    return _sequence(_digits(each=True), _byte_level(regex=True))


def _then_bytes(*splits: str, digits: bool | None = None, trim_offsets: bool = True):
    """Split by each regex in turn (then digits, one by one or in runs), then map to bytes unsplit."""
    steps = [_split(p) for p in splits] + ([] if digits is None else [_digits(each=digits)])
    return _sequence(*steps, _byte_level(regex=False, trim_offsets=trim_offsets))


def _falcon():
    from tokenizers import pre_tokenizers

    return _sequence(
        pre_tokenizers.Punctuation(behavior="contiguous"), _byte_level(regex=True), _digits(each=False), _split("[0-9][0-9][0-9]")
    )


def _deepseek_llm():
    return _then_bytes("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+$", _DEEPSEEK_CJK, digits=False)


def _deepseek_coder():
    return _then_bytes("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, digits=True)


_P = Pretokenization
PRETOKENIZATIONS: dict[str, Pretokenization] = {
    "default": _P("GPT-2 (llama.cpp's default)", _gpt2),
    "gpt2": _P("GPT-2", _gpt2),
    "gpt-2": _P("openai-community/gpt2", _gpt2),
    "phi-2": _P("microsoft/phi-2", _gpt2),
    "mpt": _P("mosaicml/mpt-7b (EleutherAI/gpt-neox-20b)", _gpt2, nfc=True),
    "smollm": _P("HuggingFaceTB/SmolLM-135M, SmolLM2", _digits_then_gpt2),
    "starcoder": _P("bigcode/starcoder2-3b", _digits_then_gpt2),
    "command-r": _P("CohereForAI/c4ai-command-r-v01", _digits_then_gpt2, nfc=True),
    "llama-bpe": _P("meta-llama/Meta-Llama-3-8B", lambda: _then_bytes(_CL100K), ignore_merges=True, add_bos=True),
    "dbrx": _P("databricks/dbrx-base", lambda: _then_bytes(_CL100K)),
    "smaug-bpe": _P("abacusai/Smaug-Llama-3-70B-Instruct", lambda: _then_bytes(_CL100K)),
    "qwen2": _P("Qwen/Qwen1.5-7B", lambda: _then_bytes(_QWEN2, trim_offsets=False), nfc=True),
    "stablelm2": _P("stabilityai/stablelm-2-zephyr-1_6b", lambda: _then_bytes(_QWEN2)),
    "tekken": _P("mistralai/Mistral-Nemo-Base-2407", lambda: _then_bytes(_TEKKEN), ignore_merges=True, add_bos=True),
    "bloom": _P("bigscience/bloom", lambda: _then_bytes(_BLOOM)),
    "poro-chat": _P("LumiOpen/Poro-34B-chat", lambda: _then_bytes(_BLOOM)),
    "gpt3-finnish": _P("TurkuNLP/gpt3-finnish-small", lambda: _then_bytes(_BLOOM)),
    "viking": _P("LumiOpen/Viking-7B", lambda: _then_bytes(_BLOOM, digits=True)),
    "falcon": _P("tiiuae/falcon-7b", _falcon),
    "deepseek-llm": _P("deepseek-ai/deepseek-llm-7b-base", _deepseek_llm),
    "deepseek-coder": _P("deepseek-ai/deepseek-coder-6.7b-base", _deepseek_coder),
}
