"""What an evaluation runs on: a compiled artifact directory or a model source, each as its
tokenizer, its longest sequence and a loader of ``logits_of(ids [S]) -> logits [S, vocab]``.

The tokenizer and the length are known before the weights load, so a bad text or window is
refused at once. A compiled artifact gives the logits of every position from one prefill
call (``prefill_bs{B}`` is exported with a dynamic length and returns ``[B, S, vocab]``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..text import Tokenizer

__all__ = ["Target", "open_target", "source_tokenizer"]

LogitsOf = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Target:
    """``kind``: "compiled" or "eager"; ``max_seq_len``: the longest sequence it takes (an
    artifact's exported cache length, a model's context); ``load()``: the model, as
    ``logits_of``."""

    kind: str
    tokenizer: Tokenizer
    max_seq_len: int
    load: Callable[[], LogitsOf]


def open_target(path: str | os.PathLike) -> Target:
    """An artifact directory (it holds ``manifest.json``) or any source ``load_model`` takes."""
    if (Path(path) / "manifest.json").is_file():
        return _compiled(Path(path))
    return _eager(str(path))


def _compiled(directory: Path) -> Target:
    from ..runtime import ArtifactError, read_manifest
    from ..text import load_tokenizer

    manifest = read_manifest(directory)
    tokenizer = load_tokenizer(directory)
    if tokenizer is None:
        raise ArtifactError(f"{directory}: the artifact has no tokenizer (its export source carried none); perplexity needs one to read the text")

    def load() -> LogitsOf:
        from ..runtime import CompiledModel

        model = CompiledModel(directory)
        # One chunk per call, into row 0 of the smallest exported batch (prefill_row is
        # prefill_bs1 for batch 1). The cache is reused: every chunk writes positions
        # 0..W-1 and a causal prefill reads no position past its own.
        batch = min(model.manifest.batch_sizes)
        cache = [model.new_cache(batch)]

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            logits, cache[0] = model.prefill_row(ids[None, :], 0, cache[0])
            return logits[0]

        return logits_of

    length = manifest.max_seq_len
    return Target("compiled", tokenizer, length, load)


def _eager(source: str) -> Target:
    from ..models.loading import load_model, weight_source

    config, _ = weight_source(source)  # deferred sources read their headers only
    tokenizer = source_tokenizer(source)

    def load() -> LogitsOf:
        model = load_model(source)

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model.prefill(ids[None, :])[0]

        return logits_of

    return Target("eager", tokenizer, config.max_seq_len, load)


def source_tokenizer(source: str) -> Tokenizer:
    """The tokenizer a model source carries (the one ``export`` copies into an artifact:
    :func:`sharktank.text.tokenizer.source_tokenizer`); raises ``TokenizerError`` when it has none."""
    from ..text import TokenizerError, tokenizer_from_gguf
    from ..text.tokenizer import TOKENIZER_FILE
    from ..text.tokenizer import source_tokenizer as carried

    tok = carried(source)
    if tok is None:
        if Path(source).suffix == ".gguf":
            return tokenizer_from_gguf(source)  # its own words: the file has no tokenizer metadata
        raise TokenizerError(f"{source}: carries no tokenizer (a theta directory, an .irpa or a checkpoint without {TOKENIZER_FILE}); perplexity needs one to read the text")
    return tok
