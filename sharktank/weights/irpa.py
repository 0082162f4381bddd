"""IREE parameter archives (``.irpa``) of plain torch tensors.

An irpa entry is raw bytes plus a metadata string. Each tensor's metadata is
``TENSORv0:{"type": "Tensor", "dtype": "bfloat16", "shape": [4, 8]}``, the layout
``iree.runtime.io`` writes for numpy arrays, with torch dtype names so that bfloat16
and the float8 types keep their identity. Archive-wide metadata (a JSON object) is the
entry ``__metadata__``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ._files import atomic_file
from .errors import WeightsError

__all__ = ["save_irpa", "load_irpa", "load_irpa_metadata", "irpa_keys"]

METADATA_KEY = "__metadata__"
_PREFIX = "TENSORv0:"


def save_irpa(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> None:
    """Write ``tensors`` (and an optional JSON-able ``metadata`` dict) to an irpa file.

    The file is written next to ``path`` and renamed into place, so ``path`` never holds
    a half-written archive.
    """
    from iree.runtime import ParameterIndex

    index = ParameterIndex()
    keep_alive = []  # the index refers to the buffers until the archive is written
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"irpa entry {name!r} must be a torch.Tensor, found {type(t).__name__}")
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY!r} is reserved for the archive metadata")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        keep_alive.append(data)
        info = {"type": "Tensor", "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        index.add_buffer(name, data, metadata=_PREFIX + json.dumps(info))
    if metadata is not None:
        index.add_buffer(METADATA_KEY, json.dumps(metadata).encode(), metadata="JSON")
    with atomic_file(path) as tmp:
        index.create_archive_file(str(tmp))


def load_irpa(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read every tensor of an irpa file written by :func:`save_irpa` (copied into memory)."""
    out = {}
    for name, entry in _entries(path):
        if name != METADATA_KEY:
            out[name] = _tensor(path, name, entry)
    return out


def load_irpa_metadata(path: str | os.PathLike) -> dict[str, Any] | None:
    """The ``metadata`` dict given to :func:`save_irpa`, or None when there was none."""
    for name, entry in _entries(path):
        if name == METADATA_KEY:
            try:
                return json.loads(bytes(entry.file_view))
            except (ValueError, UnicodeDecodeError) as e:
                raise WeightsError(f"archive metadata is not JSON: {e}", path=path) from None
    return None


def irpa_keys(path: str | os.PathLike) -> list[str]:
    """The tensor names stored in an irpa file, in file order."""
    return [name for name, _ in _entries(path) if name != METADATA_KEY]


def _entries(path: str | os.PathLike) -> list[tuple[str, Any]]:
    from iree.runtime import ParameterIndex

    if not Path(path).is_file():
        raise WeightsError("irpa file not found", path=path)
    index = ParameterIndex()
    try:
        index.load(str(path), format="irpa")
        items = index.items()
    except Exception as e:  # the runtime raises IndexError/ValueError/RuntimeError by case
        raise WeightsError(f"not a readable irpa archive: {e}", path=path) from None
    seen = set()
    for name, entry in items:
        if name in seen:
            raise WeightsError("duplicate entry", path=path, tensor=name)
        seen.add(name)
        if not entry.is_file:
            raise WeightsError("entry is not stored in the file (splat entries are not supported)", path=path, tensor=name)
    return items


def _tensor(path, name: str, entry) -> torch.Tensor:
    meta = entry.metadata.decode(errors="replace")
    if not meta.startswith(_PREFIX):
        raise WeightsError(f"entry metadata {meta[:60]!r} does not describe a tensor", path=path, tensor=name)
    try:
        info = json.loads(meta[len(_PREFIX) :])
        dtype = _dtype(info["dtype"])
        shape = [int(d) for d in info["shape"]]
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"bad tensor metadata {meta[:100]!r}: {e}", path=path, tensor=name) from None
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if entry.length != nbytes:
        raise WeightsError(f"{entry.length} bytes stored, {nbytes} expected for {info['dtype']} {shape}", path=path, tensor=name)
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        out.numpy()[:] = np.frombuffer(entry.file_view, dtype=np.uint8)
    return out.view(dtype).reshape(shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
