"""A stand-in that follows the Engine contract while the engine is on its own branch."""

from __future__ import annotations

import queue
import sys
import threading
import time
import types
from dataclasses import dataclass

from sharktank.runtime.compiled import InputError


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class Event:
    token: int | None
    finish_reason: str | None
    error: str | None = None


class _Req:
    def __init__(self, id, prompt, params, on_event):
        self.id, self.prompt_tokens, self.params, self.on_event = id, len(prompt), params, on_event
        self.last, self.made, self.cancelled = prompt[-1], 0, threading.Event()

    def cancel(self):
        self.cancelled.set()


class FakeEngine:
    """Echo engine: each row emits last+1, last+2, ... (mod vocab), one per step."""

    def __init__(self, *, batch_size=4, max_queue=4, max_seq_len=128, vocab_size=256, step_s=0.001):
        self.batch_size, self.max_queue, self.max_seq_len, self.vocab_size, self.step_s = batch_size, max_queue, max_seq_len, vocab_size, step_s
        self._waiting = queue.Queue()
        self._rows = []
        self._stop = threading.Event()
        self._n = 0

    def start(self):
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(1)

    def submit(self, prompt, params, on_event):
        if not prompt:
            raise InputError("empty prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InputError(f"token ids must be in [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise InputError(f"prompt {len(prompt)} + max_tokens {params.max_tokens} > max_seq_len {self.max_seq_len}")
        if self._waiting.qsize() >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests waiting")
        self._n += 1
        r = _Req(self._n, prompt, params, on_event)
        self._waiting.put(r)
        return r

    def _loop(self):
        while not self._stop.is_set():
            while len(self._rows) < self.batch_size and not self._waiting.empty():
                self._rows.append(self._waiting.get())
            for r in list(self._rows):
                if r.cancelled.is_set():
                    self._rows.remove(r)
                    r.on_event(Event(None, "cancelled"))
                    continue
                r.last = (r.last + 1) % self.vocab_size
                r.made += 1
                stop = r.last in r.params.stop_token_ids
                fin = "stop" if stop else "length" if r.made >= r.params.max_tokens else None
                r.on_event(Event(r.last, fin))
                if fin:
                    self._rows.remove(r)
            time.sleep(self.step_s)


def install_missing_modules():
    """Make ``sharktank.serving.engine`` importable while its part has not landed."""
    try:
        import sharktank.serving.engine  # noqa: F401
    except ImportError:
        m = types.ModuleType("sharktank.serving.engine")
        m.QueueFull, m.Event, m.Engine = QueueFull, Event, FakeEngine
        sys.modules["sharktank.serving.engine"] = m
