"""Model weights: the Theta container and its file formats.

Formats: Hugging Face safetensors checkpoints (read), GGUF (llama.cpp layout), IREE
parameter archives, and sharded thetas as per-device archives plus a manifest. Every
loader reports a bad file with :class:`WeightsError` naming the file and tensor.
Importing this package imports no IREE module; the irpa functions load
``iree.runtime`` when called.
"""

# Theta and WeightsError first: the format modules import sharktank.models (for
# LlamaConfig), whose package init imports these two names back from here.
from .errors import WeightsError
from .theta import Theta
from .source import WeightSource

from .gguf_io import QUANTIZE_TO, gguf_source, load_gguf, quantize_gguf, save_gguf  # noqa: E402
from .hf import hf_checkpoint_source, load_hf_checkpoint  # noqa: E402
from .irpa import IrpaWriter, irpa_keys, irpa_source, load_irpa, load_irpa_metadata, save_irpa  # noqa: E402
from .sharded_io import load_theta, save_theta  # noqa: E402

__all__ = [
    "Theta",
    "WeightSource",
    "hf_checkpoint_source",
    "gguf_source",
    "quantize_gguf",
    "QUANTIZE_TO",
    "irpa_source",
    "WeightsError",
    "load_hf_checkpoint",
    "load_gguf",
    "save_gguf",
    "load_irpa",
    "save_irpa",
    "IrpaWriter",
    "load_irpa_metadata",
    "irpa_keys",
    "load_theta",
    "save_theta",
]
