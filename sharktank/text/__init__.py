"""Text in and out of a model: tokenizers, sampling, and streaming detokenization.

Imports neither IREE nor the exporter; ``run`` and ``serve`` use it.
"""

from .sampling import Sampler, SamplingParams
from .stream import DetokenizeStream
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError, load_tokenizer, tokenizer_from_gguf

__all__ = [
    "Sampler", "SamplingParams", "DetokenizeStream", "Tokenizer", "ByteTokenizer", "HFTokenizer", "TokenizerError",
    "load_tokenizer", "tokenizer_from_gguf",
]
