"""Transfers in exported MLIR text: source, destination, shape and bytes of every
``flow.tensor.transfer``, per function, as a :class:`sharktank.ops.TransferLog`.

The destination and tensor type are on the transfer itself. The source is found by
following the transferred value back through the function: an argument's device is its
``iree.abi.affinity``, a global's its ``stream.affinity``, a transfer's result lives on its
destination, and any other op's results live where its first placed operand lives
(constants have none). This reads the text the exporter writes (one op per line, one block
per function); it is a measuring tool, not a general MLIR analysis.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from sharktank.ops import TransferLog

__all__ = ["MlirTransfer", "mlir_transfers"]

_NAME = r"%[\w.$\-]+"
_DEVICE = r"#hal\.device\.(?:promise|affinity)<@__device_(\d+)>"
_FUNC = re.compile(r"^\s*func\.func\s+(?:private\s+)?@\"?([\w.$\-]+)")
_ARG = re.compile(rf"({_NAME}):\s*[^{{)%]*\{{[^}}]*iree\.abi\.affinity\s*=\s*{_DEVICE}")
_GLOBAL = re.compile(rf"^\s*util\.global\s+(?:private\s+)?(?:mutable\s+)?@(\"[^\"]+\"|[\w.$\-]+)[^=]*stream\.affinity\s*=\s*{_DEVICE}")
_DEF = re.compile(rf"^\s*((?:{_NAME}(?::\d+)?)(?:\s*,\s*{_NAME})*)\s*=\s*\"?([\w.]+)\"?(.*)$")
_USE = re.compile(rf"({_NAME})(?:#\d+)?")
_LOAD = re.compile(r"util\.global\.load\s+(?:immutable\s+)?@(\"[^\"]+\"|[\w.$\-]+)")
_TRANSFER = re.compile(rf"flow\.tensor\.transfer\s+({_NAME})(?:#\d+)?\s*:\s*tensor<([^>]*)>.*?\bto\s+{_DEVICE}")


@dataclass(frozen=True, slots=True)
class MlirTransfer:
    """One ``flow.tensor.transfer``: ``src`` None when the value's device is unknown;
    ``shape`` has None for a dynamic dim."""

    function: str
    src: int | None
    dst: int
    shape: tuple[int | None, ...]
    element_bits: int

    @property
    def nbytes(self) -> int:
        if None in self.shape:
            raise ValueError(f"transfer in @{self.function} of {self.shape} has a dynamic size; bytes are unknown")
        return math.prod(self.shape) * math.ceil(self.element_bits / 8)


def _tensor_type(body: str) -> tuple[tuple[int | None, ...], int]:
    *dims, element = body.split("x")
    bits = re.search(r"(\d+)", element)
    if not bits:
        raise ValueError(f"cannot read the element type of tensor<{body}>")
    return tuple(None if d == "?" else int(d) for d in dims), int(bits.group(1))


def mlir_transfers(mlir: str) -> dict[str, TransferLog]:
    """Every ``flow.tensor.transfer`` of each function in ``mlir``, in order."""
    globals_: dict[str, int] = {}
    out: dict[str, TransferLog] = {}
    where: dict[str, int] = {}
    log = TransferLog()
    function = ""
    for line in mlir.splitlines():
        if m := _GLOBAL.match(line):
            globals_[m.group(1).strip('"')] = int(m.group(2))
            continue
        if m := _FUNC.match(line):
            function, where = m.group(1), {a: int(d) for a, d in _ARG.findall(line)}
            log = out[function] = TransferLog()
            continue
        m = _DEF.match(line)
        if not m:
            continue
        results = [r.split(":")[0].strip() for r in m.group(1).split(",")]
        rest = m.group(2) + m.group(3)
        device = None
        if t := _TRANSFER.search(rest):
            shape, bits = _tensor_type(t.group(2))
            device = int(t.group(3))
            log.append(MlirTransfer(function, where.get(t.group(1)), device, shape, bits))
        elif g := _LOAD.search(rest):
            device = globals_.get(g.group(1).strip('"'))
        else:
            device = next((where[u] for u in _USE.findall(m.group(3)) if u in where), None)
        if device is not None:
            for r in results:
                where[r] = device
    return out
