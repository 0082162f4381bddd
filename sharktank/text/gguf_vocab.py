"""A GGUF file's ``tokenizer.ggml.*`` metadata, read and checked once (llama.cpp's keys and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from .tokenizer import TokenizerError

__all__ = ["TokenType", "GGUFVocab", "read_gguf_vocab"]


class TokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values, as llama.cpp writes them."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF says of its tokenizer; ``path`` names the file in errors."""

    path: Path
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pre: str  # tokenizer.ggml.pre ("default" when absent)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos: int | None
    eos: int | None
    unk: int | None
    eot: int | None
    eom: int | None
    add_bos: bool | None  # None: the file does not say; each kind has its default
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def check_id(self, what: str, i: int | None) -> None:
        """Refuse a special-token id outside the vocabulary."""
        if i is not None and not 0 <= i < len(self.tokens):
            raise TokenizerError(f"{self.path}: tokenizer.ggml.{what} {i} is outside the {len(self.tokens)} tokens")


def read_gguf_vocab(path: Path) -> GGUFVocab:
    """The tokenizer metadata of the GGUF at ``path``; refuses a file without any or with lists that disagree."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def get(key: str, default=None):
        field = fields.get(f"tokenizer.{key}")
        return default if field is None else field.contents()

    model = get("ggml.model")
    if model is None:
        raise TokenizerError(f"{path}: no tokenizer metadata (tokenizer.ggml.model is absent)")
    tokens = get("ggml.tokens") or []
    types = get("ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    scores = get("ggml.scores")
    for what, values in (("token types", types), ("scores", scores)):
        if values is not None and len(values) != len(tokens):
            raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(values)} {what}")
    vocab = GGUFVocab(
        path=path, model=model, pre=get("ggml.pre", "default"), tokens=tokens, types=[int(t) for t in types],
        scores=None if scores is None else [float(s) for s in scores], merges=get("ggml.merges"),
        bos=get("ggml.bos_token_id"), eos=get("ggml.eos_token_id"), unk=get("ggml.unknown_token_id"),
        eot=get("ggml.eot_token_id"), eom=get("ggml.eom_token_id"),
        add_bos=get("ggml.add_bos_token"), add_eos=bool(get("ggml.add_eos_token", False)),
        add_space_prefix=bool(get("ggml.add_space_prefix", True)), chat_template=get("chat_template"),
    )
    for what, i in (("bos_token_id", vocab.bos), ("eos_token_id", vocab.eos), ("unknown_token_id", vocab.unk),
                    ("eot_token_id", vocab.eot), ("eom_token_id", vocab.eom)):
        vocab.check_id(what, i)
    return vocab
