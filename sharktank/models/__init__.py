"""Models built with sharktank.ops (one forward for unsharded, tensor- and pipeline-parallel).

``load_model`` and friends are loaded on first use (PEP 562), so importing a submodule such
as ``sharktank.models.llama.config`` does not pull in the weight loaders.
"""

from __future__ import annotations

__all__ = ["load_model", "load_weights", "save_model_irpa", "SOURCES_HELP"]


def __getattr__(name: str):
    if name in __all__:
        from . import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'sharktank.models' has no attribute {name!r}")
