"""Models built with sharktank.ops (one forward for unsharded, tensor- and pipeline-parallel),
and their files: ``load_model`` from any source, and the Llama loaders and savers per format
(GGUF, Hugging Face checkpoints, sharded thetas), which read and write the bytes with the
model-agnostic ``sharktank.weights`` formats.

These names are loaded on first use (PEP 562), so importing a submodule such as
``sharktank.models.llama.config`` does not pull in the weight loaders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from .llama.gguf_files import gguf_source, load_gguf, quantize_gguf, save_gguf
    from .llama.hf_checkpoint import hf_checkpoint_source, load_hf_checkpoint
    from .llama.theta_dir import load_theta, save_theta
    from .loading import SOURCES_HELP, load_model, load_weights, save_model_irpa

# name -> the module (under sharktank.models) that defines it
_HOMES = {
    "load_model": "loading",
    "load_weights": "loading",
    "save_model_irpa": "loading",
    "SOURCES_HELP": "loading",
    "load_gguf": "llama.gguf_files",
    "gguf_source": "llama.gguf_files",
    "save_gguf": "llama.gguf_files",
    "quantize_gguf": "llama.gguf_files",
    "load_hf_checkpoint": "llama.hf_checkpoint",
    "hf_checkpoint_source": "llama.hf_checkpoint",
    "load_theta": "llama.theta_dir",
    "save_theta": "llama.theta_dir",
}

__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
