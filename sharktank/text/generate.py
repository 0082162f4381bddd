"""One prompt through a compiled model, batch 1: sample, stop at EOS or a stop string, stream text.

The batched, multi-request loop is the serving engine's; this is what ``sharktank run
--prompt`` needs. ``model`` is anything with ``CompiledModel``'s ``prefill``/``decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .sampling import Sampler, SamplingParams
from .stream import DetokenizeStream
from .tokenizer import Tokenizer

__all__ = ["Generation", "generate_text"]


@dataclass(frozen=True)
class Generation:
    ids: list[int]       # generated ids (an ending EOS id included)
    text: str            # their text, cut before the first stop string
    finish_reason: str   # "stop" (an EOS id or a stop string) or "length" (max_tokens)


def generate_text(
    model,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] = lambda text: None,
) -> Generation:
    """Generate from ``prompt_ids``; ``on_text`` receives each piece of final text as it comes."""
    sampler = Sampler(params)
    stream = DetokenizeStream(tokenizer, stop)
    logits, cache = model.prefill(torch.tensor([list(prompt_ids)], dtype=torch.int64), logits="last")
    ids: list[int] = []
    finish = "length"
    for step in range(params.max_tokens):
        token = sampler.next_token(logits[0, -1])
        ids.append(token)
        if token in params.stop_token_ids:
            finish = "stop"
            break
        piece, stopped = stream.push(token)
        if piece:
            on_text(piece)
        if stopped:
            finish = "stop"
            break
        if step + 1 < params.max_tokens:
            position = torch.tensor([len(prompt_ids) + step], dtype=torch.int64)
            logits, cache = model.decode(torch.tensor([token], dtype=torch.int64), cache, position)
    rest = stream.finish()
    if rest:
        on_text(rest)
    return Generation(ids, stream.text, finish)
