"""The data passed between the scheduler and the engine each step: a :class:`StepPlan` (what
to run, decided by :meth:`Scheduler.schedule`) and :class:`StepResults` (what came of it,
applied by :meth:`Scheduler.update`). Plain frozen data: no model, no threads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .events import EngineError, Event
from .request import Request

__all__ = ["PrefillRow", "PrefillCall", "DecodeBatch", "StepPlan", "StepResults"]


@dataclass(frozen=True)
class PrefillRow:
    """``request.prompt[start:end]`` written into cache row ``row`` at positions ``start..end-1``.
    Without chunked prefill every prefill is a whole prompt (``start`` 0, ``end`` the prompt's
    length); in chunked mode ``start`` may be past a reused prefix or an earlier chunk and
    ``end`` short of the prompt, and only the chunk that reaches the prompt's end yields a first
    token."""

    request: Request
    row: int
    start: int
    end: int
    pages: tuple[int, ...] = ()  # paged cache: the sequence's page table (device page ids)
    # A request resumed after a preemption (paged cache) prefills its prompt and the tokens it
    # had fed back to decode; it already has its next token, so no chunk of it yields one.
    resumed: tuple[int, ...] | None = None

    @property
    def sequence(self) -> list[int]:
        """The tokens whose entries this request's prefill writes at positions 0, 1, ...: its
        prompt, or for a resumed request its prompt and the tokens it had fed back."""
        return self.request.prompt if self.resumed is None else list(self.resumed)

    @property
    def tokens(self) -> list[int]:
        """The token ids this prefill writes."""
        return self.sequence[self.start : self.end]

    @property
    def last(self) -> bool:
        """Whether this chunk's logits give the request's first token: it ends the prompt (of a
        request not resumed)."""
        return self.resumed is None and self.end == self.request.prompt_tokens


@dataclass(frozen=True)
class PrefillCall:
    """One model call: these prompts into their rows together (a batched prefill when there are
    several, the one-row prefill for one)."""

    rows: tuple[PrefillRow, ...]


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step over every cache row: ``tokens[r]`` at ``positions[r]`` for row ``r``.
    ``requests`` are the rows whose results are kept (``(request, row)``); the others run a
    dummy token at a position their next real write overwrites before anything reads it."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    requests: tuple[tuple[Request, int], ...]
    tables: tuple[tuple[int, ...], ...] = ()  # paged cache: each row's page table


@dataclass(frozen=True)
class StepPlan:
    """What one step runs. ``finished``: events decided without the model (cancellations),
    to deliver first. ``prefills``: the calls, in order. ``decode``: the step for the rows
    already generating, or None. ``preempted``: requests sent back to the queue this step to
    free their pages for older ones (paged cache; their events continue when they are resumed,
    so the engine has nothing to deliver for them)."""

    finished: tuple[tuple[Request, Event], ...] = ()
    prefills: tuple[PrefillCall, ...] = ()
    decode: DecodeBatch | None = None
    preempted: tuple[Request, ...] = ()

    @property
    def runs_model(self) -> bool:
        """Whether the step calls the model at all."""
        return bool(self.prefills) or self.decode is not None


@dataclass(frozen=True)
class StepResults:
    """What the engine got from running a plan: each request's new token (the first after its
    prefill, the next after a decode), or why it failed, by request id."""

    tokens: Mapping[int, int] = field(default_factory=dict)
    errors: Mapping[int, EngineError] = field(default_factory=dict)
