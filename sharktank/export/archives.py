"""Writing an export's parameter archives, one ``device_{d}.irpa`` per logical device.

A shard that is one contiguous run of a tensor its source file holds as stored (a whole
tensor or rows of it, same dtype) is copied from the file into the archive without being
read into memory. Any other source tensor (converted, reordered, or cut by columns) is read
once, cut into the shards every device holds, appended to those devices' archives and
dropped before the next is read: the memory this takes is about one source tensor, whatever
the model's size.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

from ..types import stored
from ..weights import IrpaWriter
from ..weights._files import sha256_file
from .llama import ExportedWeights

__all__ = ["archive_name", "write_archives"]


def archive_name(device: int) -> str:
    return f"device_{device}.irpa"


def _nbytes(t) -> int:
    return stored(t).numel() * stored(t).element_size()


def write_archives(directory: Path, weights: ExportedWeights, progress: Callable[[str], None] = lambda msg: None) -> dict[str, dict]:
    """Write every device's archive into ``directory``; returns the manifest's file entries
    (``{name: {"device", "size", "sha256"}}``)."""
    source = weights.source
    located: dict[str, list[tuple[int, str, object]]] = {}
    by_hand: list[tuple[int, str, object]] = []  # shards that view no source tensor
    for device, entries in weights.archives.items():
        for external, shard in entries.items():
            name = source.locate(shard)
            (located.setdefault(name, []) if name is not None else by_hand).append((device, external, shard))
    total = sum(_nbytes(s) for e in weights.archives.values() for s in e.values())
    done, last = 0, time.monotonic()
    with contextlib.ExitStack() as stack:
        writers = {d: stack.enter_context(IrpaWriter(directory / archive_name(d))) for d in sorted(weights.archives)}
        for name in source.names():
            data = None
            for device, external, shard in located.get(name, ()):
                span = source.file_range(shard, name)
                if span is not None:
                    data_of_shard = stored(shard)
                    writers[device].add_range(external, *span, data_of_shard.dtype, data_of_shard.shape)
                else:
                    data = source.read(name) if data is None else data
                    writers[device].add(external, stored(source.view_of(shard, name, data)))
                done += _nbytes(shard)
            del data
            if time.monotonic() - last > 5:
                progress(f"parameters: {done / 1e9:.2f} of {total / 1e9:.2f} GB written")
                last = time.monotonic()
        for device, external, shard in by_hand:
            writers[device].add(external, stored(shard))
    files = {}
    for d in sorted(weights.archives):
        path = directory / archive_name(d)
        files[path.name] = {"device": d, "size": path.stat().st_size, "sha256": sha256_file(path)}
    return files
