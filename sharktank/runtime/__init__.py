"""Running compiled multi-device modules with the IREE runtime."""

from .compiled import ArtifactError, CompiledModel, InputError, ModelLost, read_manifest
from .session import Session

__all__ = ["Session", "CompiledModel", "ArtifactError", "InputError", "ModelLost", "read_manifest"]
