"""Measuring a model on text: perplexity as llama.cpp's ``llama-perplexity`` computes it.

:mod:`.perplexity` is the computation (pure: a ``logits_of`` callable and token ids);
:mod:`.targets` opens what it runs on (a compiled artifact or an eager model, with its tokenizer).
"""

from .perplexity import METHOD, PerplexityError, PerplexityResult, bos_to_add, check_window, perplexity
from .targets import Target, open_target, source_tokenizer

__all__ = [
    "METHOD", "PerplexityError", "PerplexityResult", "bos_to_add", "check_window", "perplexity",
    "Target", "open_target", "source_tokenizer",
]
