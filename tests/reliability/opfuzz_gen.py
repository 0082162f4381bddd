"""The generator side of the sharktank.ops fuzzer (see opfuzz.py): the pool entries it draws
operands from (:class:`Value`), the description of one op to try (:class:`Step`), and the
seeded source of shapes, tensors and placements (:class:`Gen`, with :func:`pick` and
:func:`partner` for choosing operands). The op builders that use them are in opfuzz_ops.py."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from placing import place


@dataclass
class Value:
    x: Any  # torch.Tensor or ShardedTensor
    ref: torch.Tensor


@dataclass
class Step:
    """One op to try: how to call it sharded and on torch, and what to check."""

    name: str
    call: Callable[[], Any]
    ref: Callable[[], Any]
    operands: list  # the sharded/plain operands the dispatcher sees
    kind: str = "compute"  # "compute" (placement rule applies), "collective", "argmax"
    expect: Callable[[Any], str | None] | None = None  # extra check of the result; a message on failure
    transfers: Callable[[], int] | None = None  # exact transfer count for collectives
    keep: bool = True  # add the result to the pool


class Gen:
    """Random shapes, tensors and placements for one sequence."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        # A few device groups per sequence: most operands share group 0, so that ops get past
        # the placement rule; the others (same or different shard counts) exercise it.
        n = self.rng.randint(1, 8)
        self.groups = [tuple(self.rng.sample(range(16), n))]
        self.groups.append(tuple(self.rng.sample(range(16), n)))
        self.groups.append(tuple(self.rng.sample(range(16), self.rng.randint(1, 8))))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def shape(self, rank_min: int = 1, rank_max: int = 4) -> list[int]:
        return [self.rng.randint(1, 6) for _ in range(self.rng.randint(rank_min, rank_max))]

    def tensor(self, shape, positive: bool = False) -> torch.Tensor:
        t = torch.randn(tuple(shape), generator=self.gen)
        return t.abs() + 0.5 if positive else t

    def devices(self) -> tuple[int, ...]:
        r = self.rng.random()
        return self.groups[0] if r < 0.7 else self.groups[1] if r < 0.85 else self.groups[2]

    def placed(self, t: torch.Tensor, plain_ok: bool = True, partial_ok: bool = True, devices=None) -> Any:
        kinds = (["T"] if plain_ok else []) + ["R", "R"] + (["P"] if partial_ok and t.is_floating_point() else [])
        kinds += [f"S{d}" for d in range(t.ndim)] * 2
        kind = self.rng.choice(kinds)
        return place(t, kind, devices or self.devices(), pinned=self.chance(0.3), gen=self.gen)

    def fresh(self, shape, **kw) -> Value:
        positive = kw.pop("positive", False)
        t = self.tensor(shape, positive)
        return Value(self.placed(t, **kw), t)


def pick(g: Gen, pool: list[Value], want: Callable[[Value], bool] = lambda v: True) -> Value | None:
    cands = [v for v in pool if want(v)]
    return g.rng.choice(cands) if cands else None


def partner(g: Gen, pool: list[Value], shape: list[int], **kw) -> Value:
    """A second operand broadcastable against ``shape``: from the pool when one fits, else fresh."""
    same = pick(g, pool, lambda v: list(v.ref.shape) == shape and v.ref.dtype == torch.float32)
    if same is not None and g.chance(0.5) and not kw.get("positive"):
        return same
    k = g.rng.randint(0, len(shape))
    sub = [1 if g.chance(0.25) else s for s in shape[len(shape) - k :]]
    if g.chance(0.15):
        sub = [g.rng.randint(1, 3)] + shape  # a leading batch dim on the partner
    return g.fresh(sub, **kw)
