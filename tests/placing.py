"""Build sharded versions of a torch tensor for tests (R, S(d), P, or plain)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor


def all_reduce_transfers(n: int) -> int:
    """Transfers of one all_reduce over n devices: reduce_scatter + all_gather (2N(N-1)),
    or for two devices one swap of whole shards (2)."""
    return n * (n - 1) if n == 2 else 2 * n * (n - 1)


def place(t: torch.Tensor, kind: str, devices: tuple[int, ...], pinned: bool = False, gen: torch.Generator | None = None):
    """``kind``: "T" (plain), "R", "P" (random partial sums adding up to t), or "S<d>"."""
    n = len(devices)
    if kind == "T":
        return t
    if kind == "R":
        return ReplicatedTensor(ts=[t.clone() for _ in range(n)], devices=devices, pinned=pinned)
    if kind == "P":
        if not t.is_floating_point():
            parts = [torch.zeros_like(t) for _ in range(n - 1)]
        else:
            parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        last = t - sum(parts) if parts else t.clone()
        return UnreducedTensor(ts=[*parts, last], devices=devices, pinned=pinned)
    assert kind.startswith("S")
    return SplitPrimitiveTensor(shard_dim=int(kind[1:]), ts=t, shard_count=n, devices=devices, pinned=pinned)


def kinds_for(rank: int, partial: bool = True) -> list[str]:
    return ["T", "R"] + (["P"] if partial else []) + [f"S{d}" for d in range(rank)]


@st.composite
def device_tuples(draw, min_count: int = 1, max_count: int = 8):
    n = draw(st.integers(min_count, max_count))
    return tuple(draw(st.permutations(range(16)))[:n])
