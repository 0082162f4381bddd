"""Settings the ops read while a ``with`` block is active (export's tracing switches)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def setting(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """``var`` holds ``value`` inside the block and what it held before after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
