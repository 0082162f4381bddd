"""Tokenizers: text to token ids and back, and the chat template that turns messages into a prompt.

Two kinds: :class:`ByteTokenizer` (token ``i`` is byte ``i``: the toy presets, vocab 256) and
:class:`HFTokenizer` (a ``tokenizer.json`` run by the ``tokenizers`` library; a GGUF file's
``tokenizer.ggml.*`` metadata is built into one by :func:`tokenizer_from_gguf`). An export
copies its source's tokenizer into the artifact (:func:`export_tokenizer`), with its sha256 in
the manifest; :func:`load_tokenizer` reads it back and refuses a changed file.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Sequence

from ..weights._files import resolve_inside, sha256_file

__all__ = [
    "Tokenizer", "ByteTokenizer", "HFTokenizer", "TokenizerError",
    "tokenizer_from_gguf", "load_tokenizer", "export_tokenizer", "TOKENIZER_FILE",
]

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer that cannot be built, loaded or trusted; says what was expected and found."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


class ByteTokenizer:
    """Token ``i`` is the byte ``i`` of the UTF-8 text; no BOS, no EOS, no chat template."""

    vocab_size = 256
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id = None
    chat_template = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # An incomplete or invalid UTF-8 sequence decodes to U+FFFD, as the tokenizers library does.
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        raise ValueError("this tokenizer (bytes) has no chat template")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the EOS ids, BOS id and chat template of its checkpoint.

    ``decode`` skips special tokens (BOS, EOS, chat markers), as serving APIs return text."""

    def __init__(
        self, tokenizer, *, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None, chat_template: str | None = None
    ):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.chat_template = chat_template
        outside = [i for i in (*self.eos_token_ids, self.bos_token_id) if i is not None and not 0 <= i < self.vocab_size]
        if outside:
            raise TokenizerError(f"EOS/BOS ids {outside} are outside the tokenizer's vocabulary of {self.vocab_size}")

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> HFTokenizer:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            return cls(_Tokenizer.from_file(str(path)), **kwargs)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            if isinstance(e, TokenizerError):
                raise
            raise TokenizerError(f"{path}: not a tokenizer.json the tokenizers library can read ({str(e).splitlines()[0]})") from None

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike) -> HFTokenizer:
        """The tokenizer of a Hugging Face checkpoint directory: ``tokenizer.json``, with
        ``tokenizer_config.json`` (chat template, bos/eos tokens) and the EOS ids that
        ``generation_config.json`` or ``config.json`` declare."""
        d = Path(directory)
        if not (d / TOKENIZER_FILE).is_file():
            raise TokenizerError(f"{d}: no {TOKENIZER_FILE}")
        tok = cls.from_file(d / TOKENIZER_FILE)
        settings = checkpoint_settings(d, tok.tokenizer.get_vocab(with_added_tokens=True))
        return cls(tok.tokenizer, **settings)

    def _token_string(self, i: int | None) -> str:
        return "" if i is None else (self.tokenizer.id_to_token(i) or "")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (the checkpoint's tokenizer_config.json gives none)")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return render_chat_template(
            self.chat_template, messages, bos_token=self._token_string(self.bos_token_id), eos_token=self._token_string(eos)
        )


def render_chat_template(template: str, messages: list[dict[str, str]], *, bos_token: str, eos_token: str) -> str:
    """Render a Jinja chat template for ``messages``, ending with the assistant's turn opened."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    # Templates are data from the checkpoint: rendered sandboxed. Llama 3 templates call
    # strftime_now for the date; trim/lstrip_blocks is how checkpoints' templates are written.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
        )
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def _content(token: Any) -> str | None:
    """tokenizer_config.json writes a token as its string or as ``{"content": ...}``."""
    return token.get("content") if isinstance(token, dict) else token


def _id_list(value: Any) -> list[int]:
    """config.json gives ``eos_token_id`` as one id or a list of them."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def checkpoint_settings(directory: Path, vocab: dict[str, int]) -> dict:
    """``eos_token_ids``, ``bos_token_id`` and ``chat_template`` of a checkpoint directory
    (``vocab``: its tokenizer's token ids, to resolve tokens named by their text)."""
    cfg = _read_json(directory / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    bos = vocab.get(_content(cfg.get("bos_token")))
    eos = _id_list(_read_json(directory / "generation_config.json").get("eos_token_id"))
    eos = eos or _id_list(_read_json(directory / "config.json").get("eos_token_id"))
    if not eos and _content(cfg.get("eos_token")) in vocab:
        eos = [vocab[_content(cfg.get("eos_token"))]]
    if bos is None:
        bos = _read_json(directory / "config.json").get("bos_token_id")
    return {"eos_token_ids": eos, "bos_token_id": bos if isinstance(bos, int) else None, "chat_template": template}


def tokenizer_from_gguf(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer a GGUF file carries in its ``tokenizer.ggml.*`` metadata."""
    from ._gguf import build_from_gguf

    return build_from_gguf(Path(path))


# --- artifacts -----------------------------------------------------------------------------------
def source_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer a model source carries, or None when it carries none: bytes for a preset,
    a checkpoint directory's ``tokenizer.json`` (with its checkpoint's settings), a GGUF's
    ``tokenizer.ggml.*`` metadata (``UnsupportedTokenizer`` for a kind not built here). Theta
    directories, ``.irpa`` files and checkpoints without ``tokenizer.json`` carry none."""
    from ..models.llama.presets import PRESETS

    if source in PRESETS:
        return ByteTokenizer()
    path = Path(source)
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        return HFTokenizer.from_checkpoint(path)
    if path.suffix == ".gguf" and _gguf_has_tokenizer(path):
        return tokenizer_from_gguf(path)
    return None


def export_tokenizer(source: str, directory: Path, *, vocab_size: int, progress=lambda msg: None) -> dict | None:
    """Write the tokenizer of an export ``source`` (:func:`source_tokenizer`) into
    ``directory`` and return its manifest entry, or None when the source carries none or one
    this package cannot build (the model still exports; `run --tokens` takes ids)."""
    from ._gguf import UnsupportedTokenizer

    try:
        tok = source_tokenizer(source)
    except UnsupportedTokenizer as e:
        progress(f"no tokenizer copied: {e}")
        return None
    if tok is None:
        progress(f"{source} carries no tokenizer; the artifact will take token ids only")
        return None
    if isinstance(tok, ByteTokenizer):
        entry: dict = {"kind": "bytes"}
    else:
        checkpoint = Path(source) / TOKENIZER_FILE
        if checkpoint.is_file():  # a checkpoint's own file, byte for byte
            (directory / TOKENIZER_FILE).write_bytes(checkpoint.read_bytes())
        else:  # built from GGUF metadata
            tok.tokenizer.save(str(directory / TOKENIZER_FILE))
        entry = {
            "kind": "hf",
            "file": TOKENIZER_FILE,
            "sha256": sha256_file(directory / TOKENIZER_FILE),
            "chat_template": tok.chat_template,
            "eos_token_ids": list(tok.eos_token_ids),
            "bos_token_id": tok.bos_token_id,
        }
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"{source}: the tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size {vocab_size}")
    progress(f"tokenizer: {entry['kind']} ({tok.vocab_size} tokens)")
    return entry


def _gguf_has_tokenizer(path: Path) -> bool:
    from gguf import GGUFReader

    return "tokenizer.ggml.model" in GGUFReader(str(path)).fields


def load_tokenizer(artifact_dir: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer an artifact's manifest names (its file sha256-checked); None if it has none."""
    d = Path(artifact_dir)
    mpath = d / "manifest.json"
    try:
        entry = json.loads(mpath.read_text()).get("tokenizer")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise TokenizerError(f"{mpath}: cannot read the manifest ({e})") from None
    if entry is None:
        return None
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "hf":
        raise TokenizerError(f"{mpath}: tokenizer kind must be 'bytes' or 'hf', found {kind!r}")
    try:
        path = resolve_inside(d, entry.get("file"), manifest=mpath)
    except ValueError as e:
        raise TokenizerError(str(e)) from None
    if not path.is_file():
        raise TokenizerError(f"{path}: missing (named by {mpath})")
    found = sha256_file(path)
    if found != entry.get("sha256"):
        raise TokenizerError(
            f"{path}: sha256 {found[:16]}… does not match {mpath}'s {str(entry.get('sha256'))[:16]}…; the tokenizer changed or is corrupt"
        )
    return HFTokenizer.from_file(
        path, eos_token_ids=entry.get("eos_token_ids") or (), bos_token_id=entry.get("bos_token_id"), chat_template=entry.get("chat_template")
    )
