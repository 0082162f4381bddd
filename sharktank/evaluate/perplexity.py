"""Perplexity of a token sequence, computed as llama.cpp's ``llama-perplexity`` computes it.

The method (llama.cpp ``tools/perplexity/perplexity.cpp``, ``perplexity()``, default mode):

1. The whole text is tokenized once, with the tokenizer's special tokens (so a BOS id comes
   first when the tokenizer adds one).
2. The ids are cut into ``C = len(ids) // W`` non-overlapping chunks of ``W`` ids (the window,
   llama.cpp's ``n_ctx``); ids after the last whole chunk are not used.
3. Each chunk is evaluated from scratch (an empty KV cache, positions ``0..W-1``), with its
   first id replaced by the BOS id when the tokenizer adds BOS.
4. Only the second half of each chunk is scored: with ``first = W // 2``, the logits at
   positions ``first .. W-2`` score the ids at positions ``first+1 .. W-1`` by their
   log-softmax, ``W - 1 - W // 2`` ids per chunk.
5. ``ppl = exp(mean NLL)`` over every id scored so far; the estimate after each chunk is the
   running perplexity llama.cpp prints as ``[i]ppl``.

Two differences, both in what is accepted, not in what is computed: llama.cpp refuses a text
of fewer than ``2 W`` ids, this takes one of at least ``W`` (one chunk); and ``W`` must be
even and at least 4 here (so that "the second half" is exact and scores at least one id).

:func:`perplexity` takes the model as a ``logits_of(ids [W]) -> logits [W, vocab]`` callable,
so it runs against any model (eager, compiled, a test's stand-in).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from ..text import Tokenizer

__all__ = ["PerplexityError", "PerplexityResult", "check_window", "perplexity", "bos_to_add", "METHOD"]

# The method in one paragraph: `--help` and the docs say it in these words.
METHOD = (
    "Computed as llama.cpp's llama-perplexity: the text is tokenized once (BOS first when the tokenizer adds it), "
    "cut into non-overlapping chunks of WINDOW tokens (the rest is dropped); each chunk is evaluated from scratch "
    "with its first token replaced by BOS when the tokenizer adds BOS; the logits at positions WINDOW/2 .. WINDOW-2 "
    "score the next token by log-softmax (WINDOW/2 - 1 tokens per chunk); perplexity = exp(mean negative "
    "log-likelihood) over all scored tokens, printed as a running estimate after each chunk."
)


class PerplexityError(ValueError):
    """Inputs perplexity cannot be computed on; says what was expected and what was found."""


@dataclass(frozen=True)
class PerplexityResult:
    """What :func:`perplexity` measured. ``nll``: the mean negative log-likelihood (nats)
    over ``tokens_scored`` ids; ``running``: the perplexity after each chunk;
    ``tokens_per_s``: ids evaluated (``chunks * window``) per second of evaluation."""

    ppl: float
    nll: float
    tokens_scored: int
    chunks: int
    window: int
    seconds: float
    running: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.chunks * self.window / self.seconds if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict:
        """The JSON form ``sharktank perplexity --json`` prints."""
        return {
            "ppl": self.ppl, "nll": self.nll, "tokens_scored": self.tokens_scored, "chunks": self.chunks,
            "window": self.window, "seconds": round(self.seconds, 3), "tokens_per_s": round(self.tokens_per_s, 1),
            "running_ppl": list(self.running),
        }


def check_window(window: int, n_tokens: int, max_seq_len: int | None = None) -> None:
    """Refuse a window that is odd, under 4, past ``max_seq_len`` (the model's or artifact's
    longest sequence) or longer than the text's ``n_tokens`` ids."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 4 or window % 2:
        raise PerplexityError(f"--window must be an even integer >= 4 (its second half is scored), found {window!r}")
    if max_seq_len is not None and window > max_seq_len:
        raise PerplexityError(f"--window {window} is longer than the model's max_seq_len {max_seq_len}")
    if n_tokens < window:
        raise PerplexityError(f"the text is {n_tokens} tokens, too short for one window of {window}")


def perplexity(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    ids: Sequence[int],
    window: int,
    *,
    bos_id: int | None = None,
    max_seq_len: int | None = None,
    on_chunk: Callable[[int, int, float, float], None] = lambda done, total, ppl, tok_s: None,
) -> PerplexityResult:
    """Perplexity of ``ids`` (the whole text, tokenized once) by the method of the module
    docstring. ``logits_of(chunk)`` takes int64 ids ``[window]`` and returns their logits
    ``[window, vocab]`` (any float dtype); ``bos_id``: the id that replaces each chunk's first
    id (None when the tokenizer adds no BOS); ``on_chunk(done, total, running_ppl, tok_s)``
    is called after each chunk."""
    check_window(window, len(ids), max_seq_len)
    tokens = torch.as_tensor(list(ids), dtype=torch.int64)
    chunks = len(tokens) // window
    first = window // 2
    nll, count, running = 0.0, 0, []
    t0 = time.perf_counter()
    for c in range(chunks):
        chunk = tokens[c * window : (c + 1) * window].clone()
        if bos_id is not None:
            chunk[0] = bos_id
        logits = logits_of(chunk)
        if tuple(logits.shape[:1]) != (window,) or logits.ndim != 2:
            raise PerplexityError(f"logits_of returned logits of shape {list(logits.shape)}, expected [{window}, vocab]")
        # Position j's logits predict id j+1: positions first .. window-2 score ids first+1 .. window-1.
        logp = torch.log_softmax(logits[first : window - 1].float(), dim=-1)
        picked = logp.gather(1, chunk[first + 1 :, None]).double()
        nll -= float(picked.sum())
        count += window - 1 - first
        running.append(math.exp(nll / count))
        on_chunk(c + 1, chunks, running[-1], (c + 1) * window / max(time.perf_counter() - t0, 1e-9))
    seconds = time.perf_counter() - t0
    return PerplexityResult(math.exp(nll / count), nll / count, count, chunks, window, seconds, tuple(running))


def bos_to_add(tokenizer: Tokenizer) -> int | None:
    """The BOS id each chunk starts with: the tokenizer's ``bos_token_id`` when encoding with
    special tokens puts it first (llama.cpp's ``add_bos``), else None. A tokenizer that adds
    anything else (an EOS at the end) is refused, as llama.cpp's perplexity refuses it."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    special = tokenizer.encode("a", add_special_tokens=True)
    bos = tokenizer.bos_token_id
    if special == plain:
        return None
    if bos is not None and special == [bos, *plain]:
        return bos
    raise PerplexityError(f"the tokenizer adds special tokens other than a leading BOS ({plain} -> {special}); perplexity takes none but BOS")
