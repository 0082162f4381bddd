"""A ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata (llama.cpp's keys).

Supported kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE (tokens and merges), split as ``tokenizer.ggml.pre`` names: each name in
  :data:`~sharktank.text.pretokenizers.PRETOKENIZATIONS` is the split of that model's own
  tokenizer.json (:mod:`.byte_bpe`);
- ``llama``: SentencePiece pieces, scores and token types, BPE or unigram as the scores say, with
  byte fallback and the "▁" space prefix (:mod:`.spm`).

For both, control and unknown tokens (types 3, 2) become special tokens, user-defined ones (type 4)
added tokens: matched whole in the text before it is split, control tokens skipped in decode. Text
after such a token starts afresh (for SentencePiece: with its own "▁" prefix), as llama.cpp does.
BOS/EOS are added as ``add_bos_token``/``add_eos_token`` say (BOS by default for ``llama`` and for
Llama 3 / Tekken splits); EOT and EOM ids end a turn as EOS does. Anything else is
:class:`UnsupportedTokenizer`, naming what was found and what is supported.
"""

from __future__ import annotations

from pathlib import Path

from .gguf_vocab import GGUFVocab, TokenType, read_gguf_vocab
from .tokenizer import HFTokenizer, TokenizerError

__all__ = ["build_from_gguf", "UnsupportedTokenizer"]


class UnsupportedTokenizer(TokenizerError):
    """A GGUF tokenizer of a kind this module does not build."""


def build_from_gguf(path: Path) -> HFTokenizer:
    """The tokenizer a GGUF file's metadata describes, with its BOS, EOS/EOT/EOM ids and chat template."""
    vocab = read_gguf_vocab(Path(path))
    build = {"gpt2": _byte_bpe, "llama": _sentencepiece}.get(vocab.model)
    if build is None:
        raise UnsupportedTokenizer(
            f"{path}: GGUF tokenizer model {vocab.model!r} is not supported; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
        )
    try:
        tok, add_bos, bos, eos = build(vocab)
        _add_special_tokens(tok, vocab)
    except Exception as e:  # the tokenizers library raises a bare Exception on a vocabulary it cannot take
        if type(e) is not Exception:
            raise
        raise TokenizerError(f"{path}: the tokenizers library refused this {vocab.model!r} vocabulary ({str(e).splitlines()[0]})") from None
    template = _template(vocab.tokens, bos if add_bos else None, eos if vocab.add_eos else None)
    if template is not None:
        from tokenizers import processors

        tok.post_processor = processors.Sequence([s for s in (tok.post_processor, template) if s is not None])
    ends = [i for i in (eos, vocab.eot, vocab.eom) if i is not None]
    return HFTokenizer(tok, eos_token_ids=tuple(dict.fromkeys(ends)), bos_token_id=bos, chat_template=vocab.chat_template)


def _byte_bpe(vocab: GGUFVocab):
    from .byte_bpe import build_byte_bpe
    from .pretokenizers import PRETOKENIZATIONS

    pre = PRETOKENIZATIONS.get(vocab.pre)
    if pre is None:
        raise UnsupportedTokenizer(
            f"{vocab.path}: GGUF pre-tokenizer {vocab.pre!r} is not supported; supported: {', '.join(sorted(PRETOKENIZATIONS))}"
        )
    add_bos = pre.add_bos if vocab.add_bos is None else vocab.add_bos
    return build_byte_bpe(vocab, pre), add_bos, vocab.bos, vocab.eos


def _sentencepiece(vocab: GGUFVocab):
    from .spm import build_spm

    tok = build_spm(vocab)
    # llama.cpp's defaults for SentencePiece files: BOS 1 (added), EOS 2.
    bos = 1 if vocab.bos is None else vocab.bos
    eos = 2 if vocab.eos is None else vocab.eos
    for what, i in (("bos_token_id", bos), ("eos_token_id", eos)):
        vocab.check_id(what, i)
    return tok, True if vocab.add_bos is None else vocab.add_bos, bos, eos


def _add_special_tokens(tok, vocab: GGUFVocab) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as added tokens (matched raw)."""
    from tokenizers import AddedToken

    special = (TokenType.CONTROL, TokenType.UNKNOWN)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(vocab.tokens, vocab.types) if k in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(vocab.tokens, vocab.types) if k == TokenType.USER_DEFINED])


def _template(tokens: list[str], bos: int | None, eos: int | None):
    """The post-processor adding BOS before / EOS after the text, as the file's add_*_token say."""
    from tokenizers import processors

    if bos is None and eos is None:
        return None
    ends = [(tokens[i], i) for i in (bos, eos) if i is not None]
    parts = ([tokens[bos]] if bos is not None else []) + ["$A"] + ([tokens[eos]] if eos is not None else [])
    pair = parts + ["$B:1"]
    return processors.TemplateProcessing(single=" ".join(parts), pair=" ".join(pair), special_tokens=ends)
