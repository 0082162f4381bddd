"""Byte-level BPE (GGUF ``tokenizer.ggml.model == "gpt2"``): tokens and merges, split as the model splits."""

from __future__ import annotations

from .gguf_vocab import GGUFVocab
from .pretokenizers import Pretokenization
from .tokenizer import TokenizerError

__all__ = ["build_byte_bpe"]


def build_byte_bpe(vocab: GGUFVocab, pre: Pretokenization):
    """A ``tokenizers.Tokenizer`` over the file's tokens and merges with ``pre``'s normalizer and split
    (special tokens and BOS/EOS are the caller's)."""
    from tokenizers import Tokenizer, decoders, models, processors

    if not vocab.tokens or vocab.merges is None:
        found = "merges" if vocab.tokens else "no tokens"
        raise TokenizerError(f"{vocab.path}: a 'gpt2' tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges; found {found}")
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bad = next((m for m, p in zip(vocab.merges, pairs) if len(p) != 2 or p[0] not in ids or p[1] not in ids or "".join(p) not in ids), None)
    if bad is not None:
        raise TokenizerError(f"{vocab.path}: merge {bad!r} must be two tokens of the vocabulary whose join is one too")
    tok = Tokenizer(models.BPE(vocab=ids, merges=pairs, ignore_merges=pre.ignore_merges))
    if pre.normalizer() is not None:
        tok.normalizer = pre.normalizer()
    tok.pre_tokenizer = pre.pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok
