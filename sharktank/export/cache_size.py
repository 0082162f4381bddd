"""How long an exported KV cache is: a sane default for long-context checkpoints, and a
refusal when the cache would not fit in memory.

A checkpoint's ``max_position_embeddings`` is what the model was trained for, not what a
deployment needs: Llama 3.1+ declares 131072, which for the 1B shape is a 4 GiB cache per
sequence. Without ``--max-seq-len`` the export takes ``min(declared, DEFAULT_MAX_SEQ_LEN)``
and says so.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads DEFAULT_MAX_SEQ_LEN for --help: no torch import here
    import torch

    from ..models.llama.config import LlamaConfig

__all__ = ["DEFAULT_MAX_SEQ_LEN", "CacheSizeError", "kv_cache_bytes", "host_memory_bytes", "resolve_max_seq_len"]

DEFAULT_MAX_SEQ_LEN = 4096


class CacheSizeError(ValueError):
    """A cache length that the model or the memory cannot take."""


def kv_cache_bytes(config: LlamaConfig, batch: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values of every layer for ``batch`` sequences of ``max_seq_len``."""
    per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    return per_position * max_seq_len * batch


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_available() -> int | None:
    """The memory this host can give a new allocation now (``MemAvailable``), or None where
    ``/proc/meminfo`` does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def resolve_max_seq_len(
    config: LlamaConfig,
    requested: int | None,
    batch_sizes: tuple[int, ...],
    dtype: torch.dtype,
    *,
    weight_bytes: int,
    memory_bytes: int | None,
) -> tuple[int, str]:
    """``(max_seq_len, what to tell the user)``. ``memory_bytes``: the memory the module will
    run in (the host's for a CPU target; None where it is not known here, e.g. a GPU's),
    which the weights plus the largest batch's cache must fit in."""
    declared = config.max_seq_len
    if requested is not None:
        if requested < 2:
            raise CacheSizeError(f"--max-seq-len must be >= 2 (prefill takes 2 or more tokens), found {requested}")
        if requested > declared:
            raise CacheSizeError(f"--max-seq-len {requested} is past the {declared} positions the model declares (max_position_embeddings)")
        t, how = requested, "as asked"
    else:
        t = min(declared, DEFAULT_MAX_SEQ_LEN)
        how = "the model's context" if t == declared else f"default; the model declares {declared}, --max-seq-len takes up to that"
    b = max(batch_sizes)
    cache = kv_cache_bytes(config, b, t, dtype)
    if memory_bytes is not None and weight_bytes + cache > memory_bytes:
        raise CacheSizeError(
            f"--max-seq-len {t} x batch {b} needs a {_gib(cache)} KV cache beside {_gib(weight_bytes)} of weights, "
            f"more than the {_gib(memory_bytes)} of memory here; lower --max-seq-len or the batch size"
        )
    return t, f"max_seq_len {t} ({how}): KV cache {_gib(kv_cache_bytes(config, 1, t, dtype))} per sequence, {_gib(cache)} at batch {b}"
