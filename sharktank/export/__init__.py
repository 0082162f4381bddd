"""Export sharded functions to one multi-device MLIR program and compile it with IREE.

This package imports iree-turbine and the IREE compiler; ``sharktank.ops`` does not.
"""

from .compile import TARGETS, compile_mlir, compile_flags
from .program import arg_devices, count_transfers, export_function

__all__ = ["export_function", "arg_devices", "count_transfers", "compile_mlir", "compile_flags", "TARGETS"]
