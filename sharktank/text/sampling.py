"""Choosing the next token from a row of logits: greedy, or temperature / top-k / top-p
sampling with a per-request seed.

Sampling runs on the host, on the logits the compiled module returns: a decode step already
brings one ``[vocab]`` row per sequence back for the caller, the choice costs microseconds
next to a step, and every request keeps its own generator, so a seeded request draws the
same tokens whichever batch row or neighbours it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "Sampler"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses and stops.

    ``temperature`` 0 is greedy (argmax; ``top_k``, ``top_p`` and ``seed`` then do nothing).
    ``top_k`` 0 keeps every token; ``top_p`` 1.0 keeps every token. ``seed`` None draws
    from a fresh random seed. ``max_tokens``: at most this many new tokens.
    ``stop_token_ids``: ending tokens (EOS): generation stops after producing one (it is
    returned, with finish reason ``"stop"``). Stop *strings* are matched on the decoded text
    by the caller (:class:`sharktank.text.stream.DetokenizeStream`)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, found {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], found {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no limit), found {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], found {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or null, found {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """The token choices of one request (its own generator: reproducible for a seed)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._generator = None
        if not params.greedy:
            self._generator = torch.Generator()
            if params.seed is not None:
                self._generator.manual_seed(params.seed)
            else:
                self._generator.seed()

    def next_token(self, logits: torch.Tensor) -> int:
        """The next token id from one ``[vocab]`` row of logits (any float dtype)."""
        if logits.ndim != 1:
            raise ValueError(f"next_token takes one [vocab] row of logits, found shape {list(logits.shape)}")
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        scores = logits.float() / p.temperature
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
            keep = (sorted_probs.cumsum(0) - sorted_probs) < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator))
