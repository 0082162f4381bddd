"""A submitted request: its prompt, sampling parameters, callback and cancel flag."""

from __future__ import annotations

import threading
from typing import Callable

from ..text.sampling import SamplingParams
from .events import Event

__all__ = ["Request"]


class Request:
    """A submitted request; :meth:`cancel` ends it (thread-safe). ``wake`` (the engine's) is
    set on cancel so an idle engine notices at once."""

    def __init__(self, id: int, prompt: list[int], params: SamplingParams, on_event: Callable[[Event], None], wake: threading.Event | None = None):
        self.id = id
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.params = params
        self.on_event = on_event
        self._wake = wake
        self._cancelled = threading.Event()
        self.done = False  # set on the engine thread when the last event was delivered

    def cancel(self) -> None:
        """End the request: its row is freed before the next step, and its last event has
        finish reason ``CANCELLED`` (nothing happens once it has finished)."""
        self._cancelled.set()
        if self._wake is not None:
            self._wake.set()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def __repr__(self) -> str:
        return f"Request(id={self.id}, prompt_tokens={self.prompt_tokens})"
