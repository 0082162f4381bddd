"""Export sharded functions to one multi-device MLIR program and compile it with IREE.

This package imports iree-turbine and the IREE compiler; ``sharktank.ops`` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .compile import TARGETS, compile_mlir, compile_flags
    from .program import arg_devices, count_transfers, export_function

# name -> the submodule that defines it; loaded on first use
_HOMES = {
    "export_function": "program",
    "arg_devices": "program",
    "count_transfers": "program",
    "compile_mlir": "compile",
    "compile_flags": "compile",
    "TARGETS": "compile",
}

__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
