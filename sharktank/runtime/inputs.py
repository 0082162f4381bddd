"""What a compiled model's calls accept: :class:`InputError` and the checks the contiguous
(:mod:`.compiled`) and paged (:mod:`.paged`) calls share."""

from __future__ import annotations

__all__ = ["InputError", "check_chunk", "int_list"]


class InputError(ValueError):
    """Inputs a compiled model cannot take (shape, dtype, token ids, length, batch size)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_list(values, what: str) -> list[int]:
    """``values`` as a list of integers, or :class:`InputError` naming ``what``."""
    if not isinstance(values, (list, tuple)) or not all(_is_int(v) for v in values):
        raise InputError(f"{what} must be a list of integers, found {values!r:.80}")
    return list(values)


def check_chunk(prompt, start, end) -> None:
    """Refuse a chunk ``prompt[start:end]`` that is not integer token ids and bounds with
    ``0 <= start < end <= len(prompt)`` (prefill_chunk, prefill_paged)."""
    if not isinstance(prompt, (list, tuple)) or not all(_is_int(t) for t in prompt):
        raise InputError(f"the prompt must be a list of integer token ids, found {prompt!r:.80}")
    if not (_is_int(start) and _is_int(end)) or not 0 <= start < end <= len(prompt):
        raise InputError(f"start and end must be integers with 0 <= start < end <= {len(prompt)} (the prompt's length), found {start!r} and {end!r}")
