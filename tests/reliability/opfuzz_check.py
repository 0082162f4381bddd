"""The oracle of the sharktank.ops fuzzer (see opfuzz.py): what the placement rule says for a
step's operands (:func:`placement_rule`), and the checks of a result against torch, the rule and
the sharded layout (:func:`check_step`) or of a refusal (:func:`check_refusal`)."""

from __future__ import annotations

import torch

from opfuzz_gen import Step
from sharktank import ops
from sharktank.types import ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor


def placement_rule(operands: list) -> tuple[str, tuple | None, int, bool]:
    """What the placement rule says for these operands: ("ok", devices, shards moved, pinned)
    or ("error", None, 0, False). Devices is None when no operand is sharded."""
    ts, seen = [], set()
    for o in operands:
        if isinstance(o, ShardedTensor) and id(o) not in seen:
            seen.add(id(o))
            ts.append(o)
    if not ts:
        return "ok", None, 0, False
    pinned_all = all(t.pinned for t in ts)
    if len({t.devices for t in ts}) == 1:
        return "ok", ts[0].devices, 0, pinned_all
    pins = [t for t in ts if t.pinned]
    if not pins or len({t.devices for t in pins}) > 1:
        return "error", None, 0, False
    target = pins[0].devices
    moved = 0
    for t in ts:
        if t.devices != target:
            if t.shard_count != len(target):
                return "error", None, 0, False
            moved += sum(1 for s, d in zip(t.devices, target) if s != d)
    return "ok", target, moved, pinned_all


def _consistency(x: ShardedTensor) -> str | None:
    if len(x.devices) != x.shard_count or len(set(x.devices)) != x.shard_count:
        return f"devices {x.devices} for {x.shard_count} shards"
    if isinstance(x, SplitPrimitiveTensor):
        d = x.shard_dim
        for s in x.shards:
            if s.ndim != x.ndim or list(s.shape[:d]) + list(s.shape[d + 1 :]) != list(x.shape[:d]) + list(x.shape[d + 1 :]):
                return f"split shard {list(s.shape)} does not fit global {list(x.shape)} split on {d}"
        if sum(s.shape[d] for s in x.shards) != x.shape[d]:
            return f"split sizes {x.shard_sizes} do not add up to {x.shape[d]}"
    else:
        for s in x.shards:
            if s.shape != x.shape:
                return f"{type(x).__name__} shard {list(s.shape)} is not the global shape {list(x.shape)}"
        if isinstance(x, ReplicatedTensor):
            for i, s in enumerate(x.shards[1:], 1):
                if not torch.equal(s, x.shards[0]):
                    return f"replica {i} differs from replica 0 by {float((s - x.shards[0]).abs().max()):.3g}"
    return None


def global_value(x) -> torch.Tensor:
    if isinstance(x, SplitPrimitiveTensor):
        return torch.cat(x.shards, dim=x.shard_dim)
    if isinstance(x, ReplicatedTensor):
        return x.shards[0]
    if isinstance(x, UnreducedTensor):
        return sum(x.shards[1:], x.shards[0])
    return x


def _compare(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, torch gives {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, torch gives {want.dtype}"
    if not want.is_floating_point():
        return None if torch.equal(got, want) else "integer values differ"
    scale = 1.0 + (float(want.abs().max()) if want.numel() else 0.0)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale, equal_nan=True):
        return f"values differ from torch by {float((got - want).abs().max()):.3g} (scale {scale:.3g})"
    return None


def check_step(step: Step, rule, got, want, log) -> str | None:
    status, devices, moved, pinned = rule
    if step.kind in ("compute", "argmax"):
        if status == "error":
            return "the placement rule refuses these operands, but the op ran"
        if isinstance(got, ShardedTensor):
            if got.devices != devices:
                return f"result on {got.devices}, the placement rule says {devices}"
            if got.pinned != pinned:
                return f"result pinned={got.pinned}, expected {pinned} (pinned iff every operand is)"
        elif devices is not None and not isinstance(got, torch.Tensor):
            return f"returned {type(got).__name__}"
        if step.kind == "compute" and len(log) != moved:
            return f"{len(log)} transfers, the placement rule moves {moved} shards"
    if step.transfers is not None and len(log) != step.transfers():
        return f"{len(log)} transfers, expected {step.transfers()}"
    if step.expect is not None:
        msg = step.expect(got)
        if msg:
            return msg
    if isinstance(got, ShardedTensor):
        msg = _consistency(got)
        if msg:
            return msg
    elif not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__}"
    if step.name == "argmax":
        return None
    return _compare(global_value(got), want)


def check_refusal(step: Step, rule, e: Exception) -> str | None:
    if step.kind in ("compute", "argmax"):
        if isinstance(e, ops.PlacementError) and rule[0] != "error":
            return f"PlacementError although the placement rule allows these operands: {e}"
        if rule[0] == "error" and not isinstance(e, (ops.PlacementError, ops.NoImplementationError)):
            # The rule runs right after the implementation is chosen: it must be what refuses.
            return f"{type(e).__name__} where the placement rule should refuse first: {e}"
        if "ops." not in str(e):
            return f"{type(e).__name__} does not name the op: {e}"
    if not str(e):
        return f"{type(e).__name__} with an empty message"
    return None
