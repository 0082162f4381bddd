"""Text in and out of a model: tokenizers, sampling, and streaming detokenization.

Imports neither IREE nor the exporter; ``run`` and ``serve`` use it.
"""

from .sampling import Sampler, SamplingParams

__all__ = ["Sampler", "SamplingParams"]
