"""SentencePiece tokenizers (GGUF ``tokenizer.ggml.model == "llama"``: Llama 2, Mistral, Phi-3, Gemma).

The file carries pieces, scores and token types, not which SentencePiece algorithm made them. Its
BPE trainer scores the n-th merged piece ``-n``, so whole-number scores mean BPE: rebuilt as
``tokenizers`` BPE whose merge ranks follow the merged piece's score (SentencePiece merges the
adjacent pair whose join scores highest). Other scores are unigram log-probabilities: a
``tokenizers`` Unigram (Viterbi over the same scores). Either way characters outside the pieces fall
back to ``<0xNN>`` byte tokens, and text is prepared as llama.cpp and SentencePiece's identity
normalization do: a "▁" before the text (``tokenizer.ggml.add_space_prefix``, default on) and
spaces as "▁". Only normal pieces take part in merges or the Viterbi: control, unknown, byte and
unused pieces are never matched inside text (SentencePiece keeps them out of its piece matcher).

Known differences, unigram only: two segmentations of exactly equal score are chosen between by
float64 sums here, by float32 running sums in SentencePiece; and the literal text of a byte
piece's name ("<0xE6>") with a character outside the pieces becomes that byte (tokenizers' Unigram
matches every vocabulary entry and scores unknown characters below all of them).
"""

from __future__ import annotations

from .gguf_vocab import GGUFVocab, TokenType
from .tokenizer import TokenizerError

__all__ = ["build_spm", "spm_algorithm"]

# A unigram score no path through real pieces can lose to: reserved pieces are never chosen.
_NEVER = -1e6


def spm_algorithm(scores: list[float], types: list[int]) -> str:
    """``"bpe"`` when every normal piece's score is a whole number (SentencePiece's BPE ranks), else ``"unigram"``."""
    normal = [s for s, t in zip(scores, types) if t == TokenType.NORMAL]
    return "bpe" if normal and all(float(s).is_integer() for s in normal) else "unigram"


def build_spm(vocab: GGUFVocab):
    """A ``tokenizers.Tokenizer`` equal to SentencePiece over the file's pieces (special tokens and
    BOS/EOS are the caller's)."""
    from tokenizers import Tokenizer, decoders, normalizers

    if not vocab.tokens or vocab.scores is None:
        found = "no scores" if vocab.tokens else "no tokens"
        raise TokenizerError(f"{vocab.path}: a 'llama' tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.scores; found {found}")
    unk = _unk_id(vocab)
    model = _bpe(vocab, unk) if spm_algorithm(vocab.scores, vocab.types) == "bpe" else _unigram(vocab, unk)
    tok = Tokenizer(model)
    spaces = [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if vocab.add_space_prefix else []) + spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    # Decoding drops the one space the prefix added, as SentencePiece does.
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    return tok


def _unk_id(vocab: GGUFVocab) -> int:
    """tokenizer.ggml.unknown_token_id, else the first token typed unknown, else 0 (llama.cpp's default)."""
    if vocab.unk is not None:
        return vocab.unk
    return next((i for i, t in enumerate(vocab.types) if t == TokenType.UNKNOWN), 0)


def _unigram(vocab: GGUFVocab, unk: int):
    from tokenizers import models

    kept = (TokenType.NORMAL, TokenType.USER_DEFINED)
    pieces = [(p, s if t in kept else _NEVER) for p, s, t in zip(vocab.tokens, vocab.scores, vocab.types)]
    return models.Unigram(pieces, unk, byte_fallback=True)


def _bpe(vocab: GGUFVocab, unk: int):
    from tokenizers import models

    ids = {p: i for i, p in enumerate(vocab.tokens)}
    return models.BPE(
        vocab=ids, merges=_merges_by_score(vocab, ids), unk_token=vocab.tokens[unk], fuse_unk=True, byte_fallback=True
    )


def _merges_by_score(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best-scored join first (ties: lower ids)."""
    normal = {p for p, t in zip(vocab.tokens, vocab.types) if t == TokenType.NORMAL}
    found = []
    for piece in normal:
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                found.append((-vocab.scores[ids[piece]], ids[piece], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]
