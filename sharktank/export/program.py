"""Tracing sharded code into one MLIR program with iree-turbine.

Sharded arguments are flattened to one argument per shard (they are pytree nodes), and
each argument's device affinity is taken from the tensor's own ``devices``, never from
its position among the shards.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..types import ShardedTensor

__all__ = ["arg_devices", "export_function", "count_transfers"]


def arg_devices(args: tuple, default_device: int = 0) -> list[int]:
    """The logical device of each flattened argument, in torch.export's argument order.

    Shards go to their tensor's ``devices``; plain tensors to ``default_device``.
    """
    leaves, _ = pytree.tree_flatten(args, is_leaf=lambda x: isinstance(x, ShardedTensor))
    out: list[int] = []
    for leaf in leaves:
        if isinstance(leaf, ShardedTensor):
            out.extend(leaf.devices)
        elif isinstance(leaf, torch.Tensor):
            out.append(default_device)
    return out


class _Wrap(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def export_function(fn: Callable, args: tuple, *, function_name: str = "main", default_device: int = 0, dynamic_shapes=None, strict: bool = True) -> Any:
    """Export ``fn(*args)`` with iree-turbine; returns turbine's ``ExportOutput``.

    Sharded results are returned as their shards (one result per shard). ``dynamic_shapes``:
    as ``torch.export.export`` takes it (one entry per argument, in order). ``strict=False``:
    torch.export's non-strict mode (the Python code runs as in eager), which functions that
    set an op setting such as ``ops.block_kernels`` inside need (dynamo cannot trace a
    ContextVar), as the model exports do.
    """
    from iree.turbine import aot
    from iree.turbine.aot import DeviceAffinity

    devices = arg_devices(args, default_device)
    module = fn if isinstance(fn, torch.nn.Module) else _Wrap(fn)
    return aot.export(
        module,
        args=tuple(args),
        function_name=function_name,
        arg_device={i: DeviceAffinity(d) for i, d in enumerate(devices)},
        # A wrapped function's forward takes *args: torch.export matches them as one tuple.
        dynamic_shapes=(tuple(dynamic_shapes),) if dynamic_shapes is not None and isinstance(module, _Wrap) else dynamic_shapes,
        strict_export=strict,
    )


_TRANSFER = re.compile(r"\bflow\.tensor\.transfer\b")


def count_transfers(mlir: str) -> int:
    """Number of ``flow.tensor.transfer`` ops in MLIR text."""
    return len(_TRANSFER.findall(mlir))
