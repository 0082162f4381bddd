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

from .errors import WeightsError
from .theta import Theta
from .source import WeightSource

from .gguf_read import GgufFile, GgufTensor, read_gguf
from .gguf_write import QUANTIZE_TO, quantized_entries, tensor_entry, write_gguf
from .hf import CheckpointFiles, scan_checkpoint
from .irpa import IrpaWriter, irpa_keys, irpa_source, load_irpa, load_irpa_metadata, save_irpa
from .sharded_io import load_sharded, save_sharded

__all__ = [
    "Theta",
    "WeightSource",
    "WeightsError",
    "GgufFile",
    "GgufTensor",
    "read_gguf",
    "write_gguf",
    "tensor_entry",
    "quantized_entries",
    "QUANTIZE_TO",
    "CheckpointFiles",
    "scan_checkpoint",
    "irpa_source",
    "load_irpa",
    "save_irpa",
    "IrpaWriter",
    "load_irpa_metadata",
    "irpa_keys",
    "load_sharded",
    "save_sharded",
]
