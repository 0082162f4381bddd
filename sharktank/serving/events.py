"""What the engine tells a request: one :class:`Event` per generated token, the last with a
:class:`FinishReason`, and a typed :class:`EngineError` when it failed.

Both types are ``str`` subclasses, so a caller that compares them with the wire strings
(``event.finish_reason == "length"``) or prints them keeps working; code that branches on
them uses the members (``FinishReason.CANCELLED``, ``event.error.kind is ErrorKind.DECODE``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["FinishReason", "ErrorKind", "EngineError", "QueueFull", "Event"]


class FinishReason(enum.StrEnum):
    """Why a request ended; the values are the OpenAI wire strings where one exists."""

    STOP = "stop"  # a stop token (the last event's token)
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # Request.cancel(), or a client that left
    ERROR = "error"  # the event's error says why


class ErrorKind(enum.StrEnum):
    """Where a request failed."""

    PREFILL = "prefill"  # its prefill call (or sampling its first token) raised
    DECODE = "decode"  # the decode step it took part in raised
    SAMPLING = "sampling"  # sampling its next token raised
    CALLBACK = "callback"  # its own on_event raised
    STOPPED = "stopped"  # the engine stopped before it finished
    MODEL_LOST = "model_lost"  # the model can take no more calls (ModelLost)


class EngineError(str):
    """Why a request failed: the message (a ``str``) with its :class:`ErrorKind` as ``kind``."""

    kind: ErrorKind

    def __new__(cls, kind: ErrorKind, message: str) -> "EngineError":
        self = super().__new__(cls, message)
        self.kind = ErrorKind(kind)
        return self

    @classmethod
    def of(cls, kind: ErrorKind, what: str, e: BaseException) -> "EngineError":
        """``"{what} failed: {type}: {e}"``, the message every failed call gets."""
        return cls(kind, f"{what} failed: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return f"EngineError({self.kind.name}, {str(self)!r})"


class QueueFull(Exception):
    """``max_queue`` requests are already waiting for a row."""


@dataclass(frozen=True)
class Event:
    """One generated token (``finish_reason`` None while generating), or the end of a request:
    ``STOP`` (a stop token, the event's token), ``LENGTH`` (``max_tokens`` reached),
    ``CANCELLED`` or ``ERROR`` (then ``token`` is None and ``error`` says why)."""

    token: int | None
    finish_reason: FinishReason | None
    error: EngineError | None = None
