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
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ._files import atomic_file
from .errors import WeightsError
from .source import WeightSource

__all__ = ["IrpaWriter", "irpa_source", "save_irpa", "load_irpa", "load_irpa_metadata", "irpa_keys"]

METADATA_KEY = "__metadata__"
_PREFIX = "TENSORv0:"


def save_irpa(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> None:
    """Write ``tensors`` (and an optional JSON-able ``metadata`` dict) to an irpa file.

    The file is written next to ``path`` and renamed into place, so ``path`` never holds
    a half-written archive.
    """
    with IrpaWriter(path, metadata) as writer:
        for name, t in tensors.items():
            writer.add(name, t)


class IrpaWriter:
    """Writes an irpa archive one tensor at a time, holding none of them in memory.

    :meth:`add` appends a tensor's bytes to a scratch file beside ``path``; :meth:`add_range`
    names a byte range of another file that already holds a tensor as stored (a checkpoint's
    safetensors), which is never read into memory. On a clean exit from the ``with`` block the
    archive is built from those files (IREE copies the ranges) and renamed into place, and the
    scratch file is removed. On an error neither is left.
    """

    def __init__(self, path: str | os.PathLike, metadata: dict[str, Any] | None = None):
        self.path = Path(path)
        self.metadata = metadata
        self._entries: list[tuple[str, str | None, int, int, str]] = []  # name, file (None: scratch), offset, length, metadata
        self._names: set[str] = set()
        self._scratch = None
        self._file = None
        self._offset = 0

    def __enter__(self) -> "IrpaWriter":
        self._scratch = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.data")
        self._file = open(self._scratch, "wb")
        return self

    def _entry(self, name: str, file: str | None, offset: int, length: int, dtype: torch.dtype, shape) -> None:
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY!r} is reserved for the archive metadata")
        if name in self._names:
            raise ValueError(f"irpa entry {name!r} added twice")
        info = {"type": "Tensor", "dtype": _dtype_name(dtype), "shape": list(shape)}
        self._entries.append((name, file, offset, length, _PREFIX + json.dumps(info)))
        self._names.add(name)

    def add(self, name: str, t: torch.Tensor) -> None:
        """Append one tensor (its bytes are written now; the tensor may be freed after)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"irpa entry {name!r} must be a torch.Tensor, found {type(t).__name__}")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._entry(name, None, self._offset, data.nbytes, t.dtype, t.shape)
        self._file.write(data)
        self._offset += data.nbytes

    def add_range(self, name: str, file: str | os.PathLike, offset: int, length: int, dtype: torch.dtype, shape) -> None:
        """An entry whose bytes are ``length`` bytes of ``file`` at ``offset`` (a tensor of
        ``dtype`` and ``shape`` stored row-major); copied when the archive is built."""
        count = int(np.prod(list(shape), dtype=np.int64))
        if count * dtype.itemsize != length:
            raise ValueError(f"irpa entry {name!r}: {length} bytes for {_dtype_name(dtype)} {list(shape)}, expected {count * dtype.itemsize}")
        self._entry(name, str(file), offset, length, dtype, shape)

    def __exit__(self, kind, value, tb) -> None:
        from iree.runtime import FileHandle, ParameterIndex

        fds: dict[str | None, int] = {}
        try:
            self._file.close()
            if kind is not None:
                return
            index = ParameterIndex()
            handles = {}
            for file in {e[1] for e in self._entries}:
                fds[file] = os.open(self._scratch if file is None else file, os.O_RDONLY)
                handles[file] = FileHandle.wrap_fd(fds[file])
            for name, file, offset, length, meta in self._entries:
                if length:
                    index.add_from_file_handle(name, handles[file], length, offset, meta)
                else:  # a zero-length range is not a valid file span
                    index.add_buffer(name, b"", metadata=meta)
            if self.metadata is not None:
                index.add_buffer(METADATA_KEY, json.dumps(self.metadata).encode(), metadata="JSON")
            with atomic_file(self.path) as tmp:
                index.create_archive_file(str(tmp))
            del index, handles
        finally:
            for fd in fds.values():
                os.close(fd)
            self._scratch.unlink(missing_ok=True)


def load_irpa(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read every tensor of an irpa file written by :func:`save_irpa` (copied into memory)."""
    source = irpa_source(path)
    return {name: source.read(name) for name in source.names()}


def irpa_source(path: str | os.PathLike) -> WeightSource:
    """An irpa file's tensors as a :class:`WeightSource`: shapes and dtypes from the entry
    metadata (checked against the stored lengths); each tensor's bytes are read from the file
    (a positioned read, nothing left mapped) only when asked for."""
    spans: dict[str, tuple[int, int]] = {}
    specs = {}
    for name, entry in _entries(path):
        if name != METADATA_KEY:
            shape, dtype = _spec(path, name, entry)
            specs[name] = (shape, dtype)
            spans[name] = (entry.file_storage[1], entry.length)

    def read(name: str) -> torch.Tensor:
        offset, length = spans[name]
        shape, dtype = specs[name]
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), length, offset) if length else b""
        if len(data) != length:
            raise WeightsError(f"file ends {length - len(data)} bytes into this tensor", path=path, tensor=name)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape) if length else torch.empty(shape, dtype=dtype)

    return WeightSource(specs, read, spans={n: (str(path), off) for n, (off, _) in spans.items()}, label=str(path))


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


def _spec(path, name: str, entry) -> tuple[tuple[int, ...], torch.dtype]:
    meta = entry.metadata.decode(errors="replace")
    if not meta.startswith(_PREFIX):
        raise WeightsError(f"entry metadata {meta[:60]!r} does not describe a tensor", path=path, tensor=name)
    try:
        info = json.loads(meta[len(_PREFIX) :])
        dtype = _dtype(info["dtype"])
        shape = tuple(int(d) for d in info["shape"])
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"bad tensor metadata {meta[:100]!r}: {e}", path=path, tensor=name) from None
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if entry.length != nbytes:
        raise WeightsError(f"{entry.length} bytes stored, {nbytes} expected for {info['dtype']} {list(shape)}", path=path, tensor=name)
    return shape, dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
