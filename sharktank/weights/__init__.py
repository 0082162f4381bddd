"""Model weights: the Theta container and its file formats, model-agnostic.

Formats: Hugging Face safetensors checkpoints (read), GGUF, IREE parameter archives, and
sharded thetas as per-device archives plus a manifest. They deal in tensor names, dtypes,
shapes, quantized blocks and raw metadata key/values; what a model's names and keys mean
(the Llama config, llama.cpp's names and q/k row order) lives with the model:
``sharktank.models`` has the Llama loaders and savers (``load_gguf``, ``save_gguf``,
``load_hf_checkpoint``, ``save_theta``/``load_theta``, ``quantize_gguf``...). Nothing here
imports ``sharktank.models``. Every reader reports a bad file with :class:`WeightsError`
naming the file and tensor. Importing this package imports no IREE, gguf or safetensors
module; the functions load them when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .errors import WeightsError
    from .theta import Theta
    from .source import WeightSource
    from .gguf_read import GgufFile, GgufTensor, read_gguf
    from .gguf_write import QUANTIZE_TO, quantized_entries, tensor_entry, write_gguf
    from .hf import CheckpointFiles, scan_checkpoint
    from .irpa import IrpaWriter, irpa_keys, irpa_source, load_irpa, load_irpa_metadata, save_irpa
    from .sharded_io import load_sharded, save_sharded

# name -> the submodule that defines it; loaded on first use
_HOMES = {
    "Theta": "theta",
    "WeightSource": "source",
    "WeightsError": "errors",
    "GgufFile": "gguf_read",
    "GgufTensor": "gguf_read",
    "read_gguf": "gguf_read",
    "write_gguf": "gguf_write",
    "tensor_entry": "gguf_write",
    "quantized_entries": "gguf_write",
    "QUANTIZE_TO": "gguf_write",
    "CheckpointFiles": "hf",
    "scan_checkpoint": "hf",
    "irpa_source": "irpa",
    "load_irpa": "irpa",
    "save_irpa": "irpa",
    "IrpaWriter": "irpa",
    "load_irpa_metadata": "irpa",
    "irpa_keys": "irpa",
    "load_sharded": "sharded_io",
    "save_sharded": "sharded_io",
}

__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
