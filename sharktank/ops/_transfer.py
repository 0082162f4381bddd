"""Moving one shard between logical devices, and making every move visible.

In eager mode a transfer copies the tensor (the copy stands for the data now on the
destination device). While tracing for export it emits iree-turbine's
``transfer_to_logical_device`` op, which lowers to ``flow.tensor.transfer``; turbine is
imported only then, so ``import sharktank.ops`` stays light.

Every transfer made inside :func:`record_transfers` is appended to its log.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from ..types import QuantizedTensor

__all__ = ["Transfer", "TransferLog", "record_transfers", "move_tensor", "barrier_tensor", "is_tracing"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One shard moved from ``src`` to ``dst`` (``src`` is None for a plain tensor)."""

    src: int | None
    dst: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * self.dtype.itemsize

    def __str__(self) -> str:
        src = "host" if self.src is None else self.src
        return f"{src} -> {self.dst} {list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


class TransferLog(list):
    """The transfers recorded by :func:`record_transfers`, in order, with byte totals."""

    def bytes_sent(self, device: int) -> int:
        return sum(t.nbytes for t in self if t.src == device)

    def bytes_received(self, device: int) -> int:
        return sum(t.nbytes for t in self if t.dst == device)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self)

    def __str__(self) -> str:
        return "\n".join(str(t) for t in self) if self else "(no transfers)"


_logs: list[TransferLog] = []


@contextlib.contextmanager
def record_transfers() -> Iterator[TransferLog]:
    """Collect every transfer made inside the ``with`` block (nested blocks all see them).

    >>> with ops.record_transfers() as log:
    ...     y = ops.all_gather(x)
    >>> len(log), log.bytes_received(0)
    """
    log = TransferLog()
    _logs.append(log)
    try:
        yield log
    finally:
        # By identity: logs are lists, and list.remove would drop the first *equal* one.
        del _logs[next(i for i, x in enumerate(_logs) if x is log)]


def is_tracing() -> bool:
    """True while torch.compile/torch.export trace (then transfers must be IR ops)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _tracing_tensor(t: torch.Tensor) -> bool:
    if is_tracing():
        return True
    # Non-strict torch.export runs Python with fake/functional tensors.
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def move_tensor(t: torch.Tensor, src: int | None, dst: int) -> torch.Tensor:
    """Move one tensor to logical device ``dst`` (a real transfer, recorded); a quantized
    tensor moves its blocks."""
    if isinstance(t, QuantizedTensor):
        return t.with_blocks(move_tensor(t.blocks, src, dst))
    if _logs:
        rec = Transfer(src, dst, tuple(t.shape), t.dtype)
        for log in _logs:
            log.append(rec)
    if _tracing_tensor(t):
        from iree.turbine.ops.iree import transfer_to_logical_device

        return transfer_to_logical_device(f"{dst}", t)
    return t.clone()


def barrier_tensor(t: torch.Tensor, device: int) -> torch.Tensor:
    """Mark ``t`` as living on ``device`` (no data moves; identity in eager mode)."""
    if _tracing_tensor(t):
        from iree.turbine.ops.iree import barrier_on_logical_device

        return barrier_on_logical_device(f"{device}", t)
    return t
