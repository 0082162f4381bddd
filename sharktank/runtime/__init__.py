"""Running compiled multi-device modules with the IREE runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .compiled import ArtifactError, CompiledModel, InputError, ModelLost, read_manifest
    from .session import Session

# name -> the submodule that defines it; loaded on first use
_HOMES = {
    "Session": "session",
    "CompiledModel": "compiled",
    "ArtifactError": "compiled",
    "InputError": "compiled",
    "ModelLost": "compiled",
    "read_manifest": "compiled",
}

__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
