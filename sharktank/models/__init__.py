"""Models built with sharktank.ops (one forward for unsharded, tensor- and pipeline-parallel)."""

from .loading import SOURCES_HELP, load_model, load_weights, save_model_irpa

__all__ = ["load_model", "load_weights", "save_model_irpa", "SOURCES_HELP"]
