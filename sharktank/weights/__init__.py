"""Model weights: the Theta container and its file formats."""

from .theta import Theta

__all__ = ["Theta"]
