"""Hugging Face checkpoint files, model-agnostic: safetensors (one file or sharded with an index).

:func:`scan_checkpoint` reads the safetensors headers of a checkpoint directory (names,
shapes, dtypes, where each tensor's bytes are) and :meth:`CheckpointFiles.source` gives the
chosen tensors as a :class:`WeightSource`, read one at a time. ``config.json`` and what the
names mean are the model's business (``sharktank.models.llama``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from ._files import resolve_inside
from .errors import WeightsError
from .source import WeightSource

__all__ = ["CONFIG_FILE", "SINGLE_FILE", "INDEX_FILE", "CheckpointFiles", "scan_checkpoint"]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointFiles:
    """The tensors of a checkpoint directory's safetensors files, from their headers."""

    directory: Path
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]  # every tensor the files hold
    files: dict[str, Path]  # name -> the file holding it
    listed: dict[str, Path]  # name -> the file the index names (empty without an index)

    def file_of(self, name: str) -> Path:
        """The file to name in an error about ``name`` (its file, or the index, or the single file)."""
        return self.files.get(name) or self.listed.get(name) or _source(self.directory)

    def source(
        self, names: Iterable[str], *, renames: Mapping[str, str] | None = None, stacks: Mapping[str, Sequence[str]] | None = None
    ) -> WeightSource:
        """The tensors ``names`` (in that order) as a :class:`WeightSource`: each tensor's bytes
        are read from its file only when asked for. ``renames``: names among ``names`` that are
        the file tensor given under another name. ``stacks``: names that are the file tensors
        listed, stacked on a new leading dim (read together)."""
        renames, stacks = dict(renames or {}), dict(stacks or {})
        ordered = {
            name: self.stacked_spec(stacks[name]) if name in stacks else self.specs[renames.get(name, name)] for name in names
        }
        offsets: dict[str, int] = {}
        for file in set(self.files.values()):
            offsets.update({n: o for n, o in _data_offsets(file).items() if self.files.get(n) == file})
        stored = {name: renames.get(name, name) for name in ordered if name not in stacks}
        spans = {name: (str(self.files[f]), offsets[f]) for name, f in stored.items() if f in offsets}

        def read(name: str) -> torch.Tensor:
            if name in stacks:
                return torch.stack([_read_tensor(self.files[part], part) for part in stacks[name]])
            return _read_tensor(self.files[stored[name]], stored[name])

        return WeightSource(ordered, read, spans=spans, label=str(self.directory))

    def stacked_spec(self, parts: Sequence[str]) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the file tensors ``parts`` stacked on a new leading dim; parts
        missing or unlike the first raise :class:`WeightsError` naming the file and tensor."""
        for part in parts:
            if part not in self.specs:
                raise WeightsError("missing", path=self.file_of(part), tensor=part)
        shape, dtype = self.specs[parts[0]]
        for part in parts[1:]:
            if self.specs[part] != (shape, dtype):
                found, found_dtype = self.specs[part]
                raise WeightsError(
                    f"{found_dtype} {list(found)} unlike {parts[0]!r} ({dtype} {list(shape)}), with which it is stacked",
                    path=self.file_of(part), tensor=part,
                )
        return (len(parts), *shape), dtype


def scan_checkpoint(directory: str | os.PathLike) -> CheckpointFiles:
    """Names, shapes and dtypes of every tensor in ``directory``'s safetensors files, from the
    headers alone. A missing, unreadable or inconsistent file raises :class:`WeightsError`."""
    directory = Path(directory)
    plan, listed = _plan(directory)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    files: dict[str, Path] = {}
    for file, names in plan.items():
        for name, spec in _read_headers(file, names).items():
            specs[name] = spec
            files[name] = file
    return CheckpointFiles(directory, specs, files, listed)


def _source(directory: Path) -> Path:
    index = directory / INDEX_FILE
    return index if index.exists() else directory / SINGLE_FILE


def _plan(directory: Path) -> tuple[dict[Path, list[str] | None], dict[str, Path]]:
    """Files to read with the names each should hold (None: all it has), and name -> file."""
    index = directory / INDEX_FILE
    if not index.exists():
        single = directory / SINGLE_FILE
        if not single.is_file():
            raise WeightsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}", path=single)
        return {single: None}, {}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"not a safetensors index: {type(e).__name__}: {e}", path=index) from None
    listed = {name: resolve_inside(directory, f, manifest=index) for name, f in weight_map.items()}
    files: dict[Path, list[str] | None] = {}
    for name, file in sorted(listed.items(), key=lambda kv: str(kv[1])):
        files.setdefault(file, []).append(name)
    return files, listed


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def _read_headers(file: Path, names: list[str] | None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the named tensors of one file (all of them for ``names=None``),
    from its header alone."""
    from safetensors import safe_open

    if not file.is_file():
        raise WeightsError("safetensors file not found", path=file, tensor=names[0] if names else None)
    out = {}
    current = None
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for name in sorted(keys) if names is None else names:
                current = name
                if name not in keys:
                    raise WeightsError("listed in the index but not in this file", path=file, tensor=name)
                info = f.get_slice(name)
                kind = info.get_dtype()
                if kind not in _DTYPES:
                    raise WeightsError(f"dtype {kind} is not supported (supported: {', '.join(_DTYPES)})", path=file, tensor=name)
                out[name] = (tuple(int(d) for d in info.get_shape()), _DTYPES[kind])
    except WeightsError:
        raise
    except Exception as e:  # safetensors raises SafetensorError, OSError or ValueError by case
        raise WeightsError(f"not a readable safetensors file: {e}", path=file, tensor=current) from None
    return out


def _data_offsets(file: Path) -> dict[str, int]:
    """Where each tensor's bytes start in a safetensors file: after the 8-byte little-endian
    header length and the JSON header, at the tensor's ``data_offsets[0]`` (the format's own
    layout; the library reads headers but does not expose these). Unusable headers give {}:
    the tensors are then read through the library."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        return {name: 8 + length + int(info["data_offsets"][0]) for name, info in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return {}


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    """One tensor's bytes. The file is opened (mapped) for this read only, so pages read for
    one tensor do not stay mapped while the next ones are read."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)
    except Exception as e:  # the file changed or broke since its header was read
        raise WeightsError(f"not a readable safetensors file: {e}", path=file, tensor=name) from None
