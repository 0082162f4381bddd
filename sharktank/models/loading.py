"""One entry point from a weights source to a (possibly sharded) model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import ops
from ..parallel import ParallelPlan, PlanError, plan_from_directives
from ..types import ShardedTensor
from ..weights import Theta, WeightSource, WeightsError
from .llama.config import LlamaConfig
from .llama.layout import layout_problem
from .llama.model import LlamaModel
from .llama.presets import PRESET_DTYPES, PRESETS, random_theta

__all__ = ["load_weights", "weight_source", "load_model", "model_from_manifest", "save_model_irpa", "SOURCES_HELP"]

SOURCES_HELP = (
    f"a preset ({', '.join(sorted(PRESETS))}), a Hugging Face checkpoint directory (config.json + "
    "*.safetensors), a saved sharded theta directory (theta.json), a .gguf file or a .irpa file"
)


def load_weights(source: str | os.PathLike, *, seed: int = 0) -> tuple[LlamaConfig, Theta]:
    """Config and unsharded weights (Hugging Face names) from any supported source."""
    config, weights = weight_source(source, seed=seed)
    return config, Theta({name: weights.read(name) for name in weights.names()})


def weight_source(source: str | os.PathLike, *, seed: int = 0) -> tuple[LlamaConfig, WeightSource]:
    """Config and weights of any supported source, as a :class:`WeightSource`: deferred
    (shapes now, bytes when read) for Hugging Face checkpoints, ``.gguf`` and ``.irpa``
    files; in memory for presets and saved sharded thetas."""
    from ..weights import irpa_source, load_irpa_metadata
    from .llama.gguf_files import gguf_source
    from .llama.hf_checkpoint import hf_checkpoint_source
    from .llama.theta_dir import load_theta

    if isinstance(source, str) and source in PRESETS:
        config = PRESETS[source]
        return config, WeightSource.of(random_theta(config, seed, PRESET_DTYPES.get(source, torch.float32)), source)
    path = Path(source)
    if path.is_dir():
        if (path / "theta.json").exists():
            config, theta = load_theta(path)
            theta = theta.map(lambda _, t: ops.unshard(t) if isinstance(t, ShardedTensor) else t)
            return config, WeightSource.of(_checked(config, theta, path / "theta.json"), str(path))
        if (path / "config.json").exists():
            return hf_checkpoint_source(path)
        raise WeightsError(f"directory has neither config.json nor theta.json; expected {SOURCES_HELP}", path=path)
    if path.suffix == ".gguf":
        return gguf_source(path)
    if path.suffix == ".irpa":
        meta = load_irpa_metadata(path) or {}
        if "config" not in meta:
            raise WeightsError("archive has no model config in its metadata (write it with save_model_irpa)", path=path)
        try:
            config = LlamaConfig.from_dict(meta["config"])
        except (TypeError, ValueError) as e:
            raise WeightsError(f"bad model config in metadata: {e}", path=path) from None
        weights = irpa_source(path)
        _checked(config, weights.theta, path)
        return config, weights
    if not path.exists():
        raise WeightsError(f"no such model source; expected {SOURCES_HELP}", path=path)
    raise WeightsError(f"unrecognized model file; expected {SOURCES_HELP}", path=path)


def _checked(config: LlamaConfig, theta: Theta, path: Path) -> Theta:
    """Refuse tensors whose names or shapes disagree with the config (naming file and tensor)."""
    problem = layout_problem({k: tuple(v.shape) for k, v in theta.items()}, config)
    if problem is not None:
        raise WeightsError(problem[1], path=path, tensor=problem[0])
    return theta


def save_model_irpa(path: str | os.PathLike, config: LlamaConfig, theta: Theta) -> None:
    """Write unsharded weights and their config to one ``.irpa`` (what ``load_model`` reads)."""
    from ..weights import save_irpa

    plain = {k: ops.unshard(v) if isinstance(v, ShardedTensor) else v for k, v in theta.items()}
    save_irpa(path, plain, metadata={"config": config.to_dict()})


def load_model(
    source: str | os.PathLike,
    *,
    tp: int = 1,
    ep: int = 1,
    pp: int | None = None,
    placement: str | os.PathLike | Sequence[Any] | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    deferred: bool = False,
) -> LlamaModel:
    """A model from ``source`` sharded ``tp``-way, in ``pp`` pipeline stages or as the
    ``placement`` directives say (a JSON file path or a list of directives).

    ``source``: a preset name (``toy-llama``, ``toy-llama-3l``: seeded random weights), a Hugging
    Face checkpoint directory, a saved sharded theta directory, a ``.gguf`` or an ``.irpa``.
    ``dtype`` (float32, float16 or bfloat16) converts the weights; activations follow them, with
    norms, rotary angles and attention computed in float32 as the reference does. The model's ``prefill(tokens) -> logits`` and
    ``generate(tokens, max_new_tokens) -> ids`` take and return plain torch tensors.

    ``ep``: expert parallelism for a mixture of experts: 1 (each expert split ``tp``-way as
    the dense FFN); ``tp`` (whole experts per device over each tensor-parallel group, ``E``
    divisible by it; `export --ep`); or, with ``tp=1``, any ``ep`` dividing ``E``: expert
    parallelism alone, each stage on ``ep`` devices that hold whole experts and replicate
    every other weight (attention runs whole on each, over a replicated KV cache: one
    all-reduce per block instead of two, for ``ep`` copies of the attention weights and cache).

    ``deferred=True``: the model holds placeholder weights (shapes and dtypes, no memory) and
    its ``source`` reads the bytes when an export writes the parameter archives, one tensor
    at a time; such a model can be exported but not run eagerly. Presets and sharded thetas
    are read into memory either way.
    """
    if ep < 1 or (ep not in (1, tp) and tp != 1):
        raise PlanError(
            f"ep={ep} with tp={tp}: ep must be 1, equal tp (experts split over the tensor-parallel group) "
            f"or go with tp=1 (expert parallelism alone, on ep devices per stage)"
        )
    alone = tp == 1 and ep > 1
    group = ep if alone else tp
    config, weights = weight_source(source, seed=seed)
    if dtype is not None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, found {dtype}")
        weights = weights.to(dtype)
    if not deferred and weights.deferred:
        weights = WeightSource.of(Theta({name: weights.read(name) for name in weights.names()}), weights.label)
    if placement is not None:
        plan = plan_from_directives(placement, config.num_layers, tp=group, pp=pp)
    else:
        plan = ParallelPlan.from_tp_pp(config.num_layers, group, pp or 1)
    return LlamaModel(config, weights.theta, plan, source=weights, experts="experts" if ep > 1 else "ffn", dense="replicated" if alone else "split")


def model_from_manifest(manifest) -> LlamaModel:
    """The eager model an export artifact was made from (its source, dtype, plan and expert
    split, as its :class:`~sharktank.export.manifest.Manifest` records them): what
    ``run --compare-eager`` compares the compiled module with."""
    _, theta = load_weights(manifest.source)
    dtype = getattr(torch, manifest.dtype)
    theta = theta.map(lambda _, t: t.to(dtype) if t.is_floating_point() else t)
    return LlamaModel(LlamaConfig.from_dict(manifest.config), theta, ParallelPlan.from_dict(manifest.parallel), experts=manifest.experts or "ffn",
                      dense=manifest.dense)

