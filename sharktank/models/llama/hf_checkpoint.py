"""Llama-family models (Llama, Mistral, Qwen2, Qwen3) as Hugging Face checkpoints: ``config.json``
plus safetensors (one file or sharded).

The safetensors files are read by the model-agnostic ``sharktank.weights.scan_checkpoint``;
this module turns ``config.json`` into a :class:`LlamaConfig`, drops what is no parameter
(rotary buffers, a tied LM head) and checks the rest against the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...weights import Theta, WeightSource, WeightsError, scan_checkpoint
from ...weights.hf import CONFIG_FILE
from .config import LlamaConfig
from .layout import layout_problem, llama_shapes

__all__ = ["load_hf_checkpoint", "hf_checkpoint_source"]


def load_hf_checkpoint(path: str | os.PathLike) -> tuple[LlamaConfig, Theta]:
    """Load a Llama checkpoint directory into (config, theta), checking every shape.

    Buffers such as ``rotary_emb.inv_freq`` are dropped, as is ``lm_head.weight`` when
    the config ties it to the embedding. Anything missing, misshapen, unexpected or
    unreadable raises :class:`WeightsError` naming the file and the tensor.
    """
    config, source = hf_checkpoint_source(path)
    return config, Theta({name: source.read(name) for name in source.names()})


def hf_checkpoint_source(path: str | os.PathLike) -> tuple[LlamaConfig, WeightSource]:
    """A checkpoint's config and its weights as a :class:`WeightSource`: names, shapes and
    dtypes come from the safetensors headers (checked as :func:`load_hf_checkpoint` does);
    each tensor's bytes are read from its file only when asked for, one at a time."""
    directory = Path(path)
    config = _read_config(directory / CONFIG_FILE)
    files = scan_checkpoint(directory)
    shapes = {
        name: shape
        for name, (shape, _) in files.specs.items()
        if not (name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings))
    }
    problem = layout_problem(shapes, config)
    if problem is not None:
        name, reason = problem
        raise WeightsError(reason, path=files.file_of(name), tensor=name)
    return config, files.source(llama_shapes(config))


def _read_config(file: Path) -> LlamaConfig:
    if not file.is_file():
        raise WeightsError("not found (a checkpoint directory needs config.json)", path=file)
    try:
        return LlamaConfig.from_hf(json.loads(file.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"not a usable Llama config: {type(e).__name__}: {e}", path=file) from None
