"""What a compiled model's calls accept: :class:`InputError` and the checks the contiguous
(:mod:`.compiled`) and paged (:mod:`.paged`) calls share."""

from __future__ import annotations

import torch

__all__ = ["InputError", "LOGITS", "check_chunk", "check_keep", "int_list", "kept_logits", "last_positions"]


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


LOGITS = ("all", "last")


def last_positions(logits: str, last: list[int]) -> list[list[int]] | None:
    """A prefill's ``keep`` for its ``logits`` choice: None for ``"all"``, each row's ``last``
    position for ``"last"``."""
    if logits not in LOGITS:
        raise InputError(f"logits must be one of {LOGITS}, found {logits!r}")
    return None if logits == "all" else [[p] for p in last]


def check_keep(keep: list[list[int]] | None, shape) -> None:
    """Refuse a ``keep`` that is not ``[B, K]`` positions in ``[0, S)`` for tokens ``[B, S]``
    (the module does not bound-check the gather)."""
    if keep is None:
        return
    rows, length = shape[0], shape[1]
    ok = isinstance(keep, list) and len(keep) == rows and keep and isinstance(keep[0], list) and keep[0]
    ok = ok and all(isinstance(k, list) and len(k) == len(keep[0]) and all(_is_int(p) and 0 <= p < length for p in k) for k in keep)
    if not ok:
        raise InputError(f"keep must be {rows} equal-length non-empty lists of positions in [0, {length}), found {keep!r:.200}")


def kept_logits(logits: torch.Tensor, keep: list[list[int]]) -> torch.Tensor:
    """``logits [B, S, vocab]`` at the positions ``keep`` of each row: ``[B, K, vocab]``."""
    return torch.take_along_dim(logits, torch.tensor(keep, dtype=torch.int64)[:, :, None], 1)
