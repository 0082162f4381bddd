"""Llama models as sharded theta directories: the model-agnostic ``sharktank.weights``
per-device archives plus manifest, with a :class:`LlamaConfig` as the manifest's config."""

from __future__ import annotations

import os

from ...weights import Theta, load_sharded, save_sharded
from .config import LlamaConfig

__all__ = ["save_theta", "load_theta"]


def save_theta(directory: str | os.PathLike, config: LlamaConfig, theta: Theta) -> None:
    """Save ``config`` and a possibly sharded ``theta`` as one archive per device plus a manifest.

    The directory is built beside ``directory`` and renamed into place once complete. An
    existing ``directory`` is replaced only if it is empty or holds a ``theta.json``
    (FileExistsError otherwise), so unrelated files are never deleted.
    """
    save_sharded(directory, config.to_dict(), theta)


def load_theta(directory: str | os.PathLike) -> tuple[LlamaConfig, Theta]:
    """Load what :func:`save_theta` wrote, checking sizes, checksums, paths and shapes.

    Any problem raises :class:`WeightsError` naming the file (and tensor) concerned.
    """
    return load_sharded(directory, config_from=LlamaConfig.from_dict)
