"""Measuring a model on text: perplexity as llama.cpp's ``llama-perplexity`` computes it.

:mod:`.perplexity` is the computation (pure: a ``logits_of`` callable and token ids);
:mod:`.targets` opens what it runs on (a compiled artifact or an eager model, with its tokenizer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .perplexity import METHOD, PerplexityError, PerplexityResult, bos_to_add, check_window, perplexity
    from .targets import Target, open_target, source_tokenizer

# name -> the submodule that defines it; loaded on first use
_HOMES = {
    "METHOD": "perplexity",
    "PerplexityError": "perplexity",
    "PerplexityResult": "perplexity",
    "bos_to_add": "perplexity",
    "check_window": "perplexity",
    "perplexity": "perplexity",
    "Target": "targets",
    "open_target": "targets",
    "source_tokenizer": "targets",
}

__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
