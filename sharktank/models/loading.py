"""One entry point from a weights source to a (possibly sharded) model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import ops
from ..parallel import ParallelPlan, plan_from_directives
from ..types import ShardedTensor
from ..weights import Theta, WeightsError
from .llama.config import LlamaConfig
from .llama.model import LlamaModel
from .llama.presets import PRESET_DTYPES, PRESETS, random_theta

__all__ = ["load_weights", "load_model", "save_model_irpa", "SOURCES_HELP"]

SOURCES_HELP = (
    f"a preset ({', '.join(sorted(PRESETS))}), a Hugging Face checkpoint directory (config.json + "
    "*.safetensors), a saved sharded theta directory (theta.json), a .gguf file or a .irpa file"
)


def load_weights(source: str | os.PathLike, *, seed: int = 0) -> tuple[LlamaConfig, Theta]:
    """Config and unsharded weights (Hugging Face names) from any supported source."""
    from ..weights import load_gguf, load_hf_checkpoint, load_irpa, load_irpa_metadata, load_theta

    if isinstance(source, str) and source in PRESETS:
        config = PRESETS[source]
        return config, random_theta(config, seed, PRESET_DTYPES.get(source, torch.float32))
    path = Path(source)
    if path.is_dir():
        if (path / "theta.json").exists():
            config, theta = load_theta(path)
            theta = theta.map(lambda _, t: ops.unshard(t) if isinstance(t, ShardedTensor) else t)
            return config, _checked(config, theta, path / "theta.json")
        if (path / "config.json").exists():
            return load_hf_checkpoint(path)
        raise WeightsError(f"directory has neither config.json nor theta.json; expected {SOURCES_HELP}", path=path)
    if path.suffix == ".gguf":
        return load_gguf(path)
    if path.suffix == ".irpa":
        meta = load_irpa_metadata(path) or {}
        if "config" not in meta:
            raise WeightsError("archive has no model config in its metadata (write it with save_model_irpa)", path=path)
        try:
            config = LlamaConfig.from_dict(meta["config"])
        except (TypeError, ValueError) as e:
            raise WeightsError(f"bad model config in metadata: {e}", path=path) from None
        return config, _checked(config, Theta(load_irpa(path)), path)
    if not path.exists():
        raise WeightsError(f"no such model source; expected {SOURCES_HELP}", path=path)
    raise WeightsError(f"unrecognized model file; expected {SOURCES_HELP}", path=path)


def _checked(config: LlamaConfig, theta: Theta, path: Path) -> Theta:
    """Refuse tensors whose names or shapes disagree with the config (naming file and tensor)."""
    from ..weights.llama_layout import layout_problem

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
    pp: int | None = None,
    placement: str | os.PathLike | Sequence[Any] | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> LlamaModel:
    """A model from ``source`` sharded ``tp``-way, in ``pp`` pipeline stages or as the
    ``placement`` directives say (a JSON file path or a list of directives).

    ``source``: a preset name (``toy-llama``, ``toy-llama-3l``: seeded random weights), a Hugging
    Face checkpoint directory, a saved sharded theta directory, a ``.gguf`` or an ``.irpa``.
    ``dtype`` (float32, float16 or bfloat16) converts the weights; activations follow them, with
    norms, rotary angles and attention computed in float32 as the reference does. The model's ``prefill(tokens) -> logits`` and
    ``generate(tokens, max_new_tokens) -> ids`` take and return plain torch tensors.
    """
    config, theta = load_weights(source, seed=seed)
    if dtype is not None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, found {dtype}")
        theta = theta.map(lambda _, t: t.to(dtype) if t.is_floating_point() else t)
    if placement is not None:
        plan = plan_from_directives(placement, config.num_layers, tp=tp, pp=pp)
    else:
        plan = ParallelPlan.from_tp_pp(config.num_layers, tp, pp or 1)
    return LlamaModel(config, theta, plan)
