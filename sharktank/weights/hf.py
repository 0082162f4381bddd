"""Hugging Face Llama checkpoints: ``config.json`` plus safetensors (one file or sharded)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..models.llama.config import LlamaConfig
from ._files import resolve_inside
from .errors import WeightsError
from .llama_layout import layout_problem, llama_shapes
from .theta import Theta

__all__ = ["load_hf_checkpoint"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_checkpoint(path: str | os.PathLike) -> tuple[LlamaConfig, Theta]:
    """Load a Llama checkpoint directory into (config, theta), checking every shape.

    Buffers such as ``rotary_emb.inv_freq`` are dropped, as is ``lm_head.weight`` when
    the config ties it to the embedding. Anything missing, misshapen, unexpected or
    unreadable raises :class:`WeightsError` naming the file and the tensor.
    """
    directory = Path(path)
    config = _read_config(directory / "config.json")
    files, listed = _plan(directory)
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file, names in files.items():
        for name, t in _read_safetensors(file, names).items():
            tensors[name] = t
            where[name] = file
    for name in list(tensors):
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
            del tensors[name]
    problem = layout_problem({n: t.shape for n, t in tensors.items()}, config)
    if problem is not None:
        name, reason = problem
        raise WeightsError(reason, path=where.get(name) or listed.get(name) or _source(directory), tensor=name)
    return config, Theta({name: tensors[name] for name in llama_shapes(config)})


def _read_config(file: Path) -> LlamaConfig:
    if not file.is_file():
        raise WeightsError("not found (a checkpoint directory needs config.json)", path=file)
    try:
        return LlamaConfig.from_hf(json.loads(file.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"not a usable Llama config: {type(e).__name__}: {e}", path=file) from None


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


def _read_safetensors(file: Path, names: list[str] | None) -> dict[str, torch.Tensor]:
    """The named tensors of one file (all of them for ``names=None``)."""
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
                out[name] = f.get_tensor(name)
    except WeightsError:
        raise
    except Exception as e:  # safetensors raises SafetensorError, OSError or ValueError by case
        raise WeightsError(f"not a readable safetensors file: {e}", path=file, tensor=current) from None
    return out
