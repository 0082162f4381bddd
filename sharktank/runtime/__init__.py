"""Running compiled multi-device modules with the IREE runtime."""

from .session import Session

__all__ = ["Session"]
