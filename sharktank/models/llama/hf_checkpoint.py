"""Llama-family models (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) as Hugging Face
checkpoints: ``config.json`` plus safetensors (one file or sharded).

The safetensors files are read by the model-agnostic ``sharktank.weights.scan_checkpoint``;
this module turns ``config.json`` into a :class:`LlamaConfig`, drops what is no parameter
(rotary buffers, a tied LM head) and checks the rest against the config. Mixture-of-experts
checkpoints hold one tensor per expert under their family's names (:data:`_MOE_NAMES`);
each kind is read stacked on a leading expert dim, as the layout has it (:mod:`.layout`).
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
    config, model_type = _read_config(directory / CONFIG_FILE)
    files = scan_checkpoint(directory)
    renames, stacks = _expert_names(config, model_type)
    consumed = set(renames.values()) | {part for parts in stacks.values() for part in parts}
    shapes = {
        name: shape
        for name, (shape, _) in files.specs.items()
        if name not in consumed and not (name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings))
    }
    shapes.update({name: files.specs[part][0] for name, part in renames.items() if part in files.specs})
    shapes.update({name: files.stacked_spec(parts)[0] for name, parts in stacks.items()})  # names a missing expert
    problem = layout_problem(shapes, config)
    if problem is not None:
        name, reason = problem
        raise WeightsError(reason, path=files.file_of(renames.get(name, name)), tensor=renames.get(name, name))
    return config, files.source(llama_shapes(config), renames=renames, stacks=stacks)


# model_type -> the checkpoint's names (within model.layers.<i>.) of the router and of each
# expert's gate, up and down projections ({e}: the expert's index).
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"),
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}
_STACKED = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


def _expert_names(config: LlamaConfig, model_type: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``(renames, stacks)``: our router name -> the checkpoint's, and our stacked expert
    names -> the checkpoint's per-expert tensors, in expert order (both empty for dense models)."""
    if not config.is_moe:
        return {}, {}
    router, *experts = _MOE_NAMES[model_type]
    renames, stacks = {}, {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        if router != "mlp.gate":
            renames[p + "mlp.gate.weight"] = f"{p}{router}.weight"
        for ours, theirs in zip(_STACKED, experts):
            stacks[f"{p}{ours}.weight"] = [f"{p}{theirs.format(e=e)}.weight" for e in range(config.num_experts)]
    return renames, stacks


def _read_config(file: Path) -> tuple[LlamaConfig, str]:
    """The checkpoint's config, and its ``model_type`` (which names its tensors)."""
    if not file.is_file():
        raise WeightsError("not found (a checkpoint directory needs config.json)", path=file)
    try:
        d = json.loads(file.read_text())
        return LlamaConfig.from_hf(d), d.get("model_type", "llama")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError(f"not a usable Llama config: {type(e).__name__}: {e}", path=file) from None
