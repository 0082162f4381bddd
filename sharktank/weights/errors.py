"""The one error raised for unreadable, damaged or inconsistent weight files."""

from __future__ import annotations

import os

__all__ = ["WeightsError"]


class WeightsError(ValueError):
    """A weights file is missing, damaged, or disagrees with its config or manifest.

    The message always starts with the file (and the tensor, when one is involved), e.g.
    ``/ckpt/model.safetensors: tensor 'lm_head.weight': shape [64, 32], expected [64, 16]``.
    ``path`` and ``tensor`` keep those parts for programs.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, tensor: str | None = None):
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor
        parts = [p for p in (self.path, None if tensor is None else f"tensor {tensor!r}") if p]
        super().__init__(": ".join([*parts, message]))
