"""A ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata (llama.cpp keys).

Supported: model ``gpt2`` (byte-level BPE: ``tokens`` and ``merges``, as Llama 3 files carry),
with pre-tokenizer ``gpt2``/``default`` (GPT-2's split) or ``llama-bpe`` (Llama 3's split).
Control tokens (token type 3) become special tokens: matched whole in text, skipped in decode.
"""

from __future__ import annotations

from pathlib import Path

from .tokenizer import HFTokenizer, TokenizerError

__all__ = ["build_from_gguf", "UnsupportedTokenizer"]


class UnsupportedTokenizer(TokenizerError):
    """A GGUF tokenizer of a kind this module does not build."""


# Llama 3's pre-tokenizer split (its tokenizer.json Split pattern; llama.cpp's "llama-bpe").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE = ("gpt2", "default", "llama-bpe")
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre == "llama-bpe":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def build_from_gguf(path: Path) -> HFTokenizer:
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    fields = GGUFReader(str(path)).fields

    def get(key: str, default=None):
        field = fields.get(f"tokenizer.{key}")
        return default if field is None else field.contents()

    kind = get("ggml.model")
    if kind is None:
        raise TokenizerError(f"{path}: no tokenizer metadata (tokenizer.ggml.model is absent)")
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"{path}: GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    pre = get("ggml.pre", "default")
    if pre not in _PRE:
        raise UnsupportedTokenizer(f"{path}: GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(_PRE)}")
    tokens = get("ggml.tokens")
    merges = get("ggml.merges")
    if not tokens or merges is None:
        raise TokenizerError(f"{path}: a 'gpt2' tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges; found {'merges' if tokens else 'no tokens'}")
    types = get("ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos, eos = get("ggml.bos_token_id"), get("ggml.eos_token_id")
    for what, i in (("bos", bos), ("eos", eos)):
        if i is not None and not 0 <= i < len(tokens):
            raise TokenizerError(f"{path}: tokenizer.ggml.{what}_token_id {i} is outside the {len(tokens)} tokens")
    template = _template(tokens, bos if get("ggml.add_bos_token", False) else None, eos if get("ggml.add_eos_token", False) else None)
    steps = [processors.ByteLevel(trim_offsets=False)] + ([template] if template else [])
    tok.post_processor = processors.Sequence(steps)
    # Instruct models end a turn with EOT (Llama 3's <|eot_id|>) or EOM as well as EOS.
    ends = [i for i in (eos, get("ggml.eot_token_id"), get("ggml.eom_token_id")) if i is not None]
    return HFTokenizer(tok, eos_token_ids=tuple(dict.fromkeys(ends)), bos_token_id=bos, chat_template=get("chat_template"))


def _template(tokens: list[str], bos: int | None, eos: int | None):
    """The post-processor adding BOS before / EOS after the text, as the file's add_*_token say."""
    from tokenizers import processors

    if bos is None and eos is None:
        return None
    ends = [(tokens[i], i) for i in (bos, eos) if i is not None]
    parts = ([tokens[bos]] if bos is not None else []) + ["$A"] + ([tokens[eos]] if eos is not None else [])
    pair = parts + ["$B:1"]
    return processors.TemplateProcessing(single=" ".join(parts), pair=" ".join(pair), special_tokens=ends)
