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

from .gguf_io import load_gguf, save_gguf  # noqa: E402
from .hf import load_hf_checkpoint  # noqa: E402
from .irpa import irpa_keys, load_irpa, load_irpa_metadata, save_irpa  # noqa: E402
from .sharded_io import load_theta, save_theta  # noqa: E402

__all__ = [
    "Theta",
    "WeightsError",
    "load_hf_checkpoint",
    "load_gguf",
    "save_gguf",
    "load_irpa",
    "save_irpa",
    "load_irpa_metadata",
    "irpa_keys",
    "load_theta",
    "save_theta",
]
