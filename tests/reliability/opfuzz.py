"""Differential fuzzing of sharktank.ops: seeded random sequences of ops over sharded values.

A sequence keeps a small pool of values, each a (possibly sharded) tensor next to the plain
torch tensor it stands for. Every step picks an op and operands (from the pool or fresh,
placed as plain/R/P/S(d) on 1-8 of 16 logical devices, pinned or not), computes the torch
result, runs the sharded op and demands one of:

- a result equal to torch (allclose), with consistent shards (replicated shards identical,
  split sizes adding up), on the devices and with the pinned flag the placement rule gives,
  having made exactly the transfers the rule (or the collective's documented count) implies;
- a documented refusal: ``PlacementError`` (only when the placement rule says so),
  ``ShardingError`` or ``NoImplementationError``, with a message naming the op.

Anything else (a wrong number, another exception type, a transfer miscount) is a failure,
reported with the seed and step so that the sequence can be replayed with :func:`run_sequence`.
``python tools/soak.py`` runs many seeds; tests/reliability/test_fuzz_ops.py a CI-sized set.

This module holds the runner (:func:`run_sequence`, :func:`run_seeds`) and its tallies
(:class:`Outcome`, :class:`FuzzStats`); the values, steps and random source are in
opfuzz_gen.py, the op builders in opfuzz_ops.py, the checks in opfuzz_check.py.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch

from opfuzz_check import check_refusal, check_step, placement_rule
from opfuzz_gen import Gen, Value
from opfuzz_ops import OPS
from sharktank import ops
from sharktank.types import ShardedTensor

__all__ = ["Outcome", "FuzzStats", "run_sequence", "run_seeds"]

REFUSALS = (ops.PlacementError, ops.ShardingError, ops.NoImplementationError)
MAX_POOL = 6


@dataclass
class Outcome:
    seed: int
    ops: int = 0
    ok: int = 0
    skipped: int = 0  # drawn steps that torch itself rejects (nothing to compare)
    refused: Counter = field(default_factory=Counter)
    per_op: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


@dataclass
class FuzzStats:
    sequences: int = 0
    ops: int = 0
    ok: int = 0
    refused: Counter = field(default_factory=Counter)
    per_op: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.sequences += 1
        self.ops += o.ops
        self.ok += o.ok
        self.refused.update(o.refused)
        self.per_op.update(o.per_op)
        self.failures.extend(o.failures)

    def summary(self) -> str:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(self.refused.items()))
        return (
            f"{self.sequences} sequences, {self.ops} ops ({self.ok} matched torch; refused: {refused or 'none'}); "
            f"{len(self.per_op)} op kinds; {len(self.failures)} failures"
        )


def _describe(x) -> str:
    if isinstance(x, ShardedTensor):
        return repr(x)
    if isinstance(x, torch.Tensor):
        return f"Tensor{list(x.shape)}"
    return repr(x)


def run_sequence(seed: int, steps: int | None = None) -> Outcome:
    """Run the sequence of ``seed`` (its length drawn from the seed unless given)."""
    g = Gen(seed)
    out = Outcome(seed)
    pool: list[Value] = [g.fresh(g.shape()) for _ in range(g.rng.randint(1, 2))]
    builders, weights = zip(*OPS)
    for i in range(steps if steps is not None else g.rng.randint(4, 12)):
        builder = g.rng.choices(builders, weights)[0]
        try:
            step = builder(g, pool)
        except Exception as e:  # a bug in this generator, not in sharktank
            raise RuntimeError(f"seed {seed} step {i}: generator {builder.__name__} failed: {e}") from e
        if step is None:
            continue
        try:
            want = step.ref()
        except (RuntimeError, ValueError, IndexError, TypeError):
            out.skipped += 1
            continue  # not a valid torch program: nothing to compare
        rule = placement_rule(step.operands)
        where = f"seed {seed} step {i} {step.name}({', '.join(_describe(o) for o in step.operands)})"
        out.ops += 1
        out.per_op[step.name] += 1
        try:
            with ops.record_transfers() as log:
                got = step.call()
        except REFUSALS as e:
            out.refused[type(e).__name__] += 1
            msg = check_refusal(step, rule, e)
            if msg:
                out.failures.append(f"{where}: {msg}")
            continue
        except Exception as e:
            out.failures.append(f"{where}: raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
            continue
        msg = check_step(step, rule, got, want, log)
        if msg:
            out.failures.append(f"{where}: {msg}")
            continue
        out.ok += 1
        if step.keep and isinstance(want, torch.Tensor) and want.is_floating_point() and want.numel() <= 4096 and want.ndim <= 5:
            pool.append(Value(got, want))
            if len(pool) > MAX_POOL:
                pool.pop(0)
    return out


def run_seeds(seeds) -> FuzzStats:
    stats = FuzzStats()
    for s in seeds:
        stats.add(run_sequence(s))
    return stats
