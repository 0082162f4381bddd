"""Llama-family models."""

from .config import LlamaConfig

__all__ = ["LlamaConfig"]
