"""The placement rule (transfer-if-needed), stated and implemented once.

Before an op runs, its sharded operands (found anywhere in its arguments, including
inside lists, tuples and dicts) must live on the same devices:

1. all on the same devices: nothing moves;
2. otherwise, if some are pinned and all pinned ones are on the same devices, every
   unpinned operand is moved there, shard ``i`` to ``pinned.devices[i]``, each shard by
   a real transfer;
3. pinned operands on different devices, or different devices and none pinned: a
   :class:`PlacementError` naming the op and each operand's devices and pinned flag.

The result lives on the devices the op ran on, and is pinned exactly when every sharded
operand was pinned. Plain ``torch.Tensor`` operands take no part in the rule: an op
treats them as replicated on its sharded operands' devices (read in place, no transfer).
"""

from __future__ import annotations

from typing import Any

from ..types import ShardedTensor
from ._transfer import move_tensor

__all__ = ["PlacementError", "transfer_if_needed", "place_operands", "pin_result", "move_shards"]


class PlacementError(ValueError):
    """Operands of an op live on devices the placement rule cannot reconcile."""


def _collect(x: Any, out: list) -> None:
    if isinstance(x, ShardedTensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _collect(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, out)


def _replace(x: Any, moved: dict[int, ShardedTensor]) -> Any:
    if isinstance(x, ShardedTensor):
        return moved.get(id(x), x)
    if isinstance(x, (list, tuple)):
        ys = [_replace(y, moved) for y in x]
        if isinstance(x, list):
            return ys
        return type(x)(*ys) if hasattr(x, "_fields") else tuple(ys)
    if isinstance(x, dict):
        return {k: _replace(v, moved) for k, v in x.items()}
    return x


def move_shards(t: ShardedTensor, devices: tuple[int, ...], pinned: bool | None = None) -> ShardedTensor:
    """Move shard ``i`` of ``t`` to ``devices[i]`` (shards already there are not copied)."""
    if len(devices) != t.shard_count:
        raise PlacementError(f"cannot move {t.shard_count} shards of {t!r} to {len(devices)} devices {list(devices)}")
    shards = tuple(
        s if src == dst else move_tensor(s, src, dst) for s, src, dst in zip(t.shards, t.devices, devices)
    )
    return t.clone(ts=shards, devices=devices, pinned=t.pinned if pinned is None else pinned)


def _describe(ts: list[ShardedTensor]) -> str:
    return "; ".join(
        f"operand {i}: {type(t).__name__} devices={list(t.devices)} pinned={t.pinned}" for i, t in enumerate(ts)
    )


def _target(op: str, ts: list[ShardedTensor]) -> tuple[int, ...]:
    pinned = [t for t in ts if t.pinned]
    if not pinned:
        raise PlacementError(
            f"ops.{op}: operands are on different devices and none is pinned, so there is no "
            f"place to move them to ({_describe(ts)}). Pin one or transfer explicitly."
        )
    devices = pinned[0].devices
    if any(t.devices != devices for t in pinned):
        raise PlacementError(f"ops.{op}: pinned operands are on different devices ({_describe(ts)})")
    return devices


def _plan(op: str, ts: list[ShardedTensor]) -> dict[int, ShardedTensor]:
    devices = _target(op, ts)
    moved: dict[int, ShardedTensor] = {}
    for t in ts:
        if t.devices != devices and id(t) not in moved:
            if t.shard_count != len(devices):
                raise PlacementError(
                    f"ops.{op}: cannot move {t.shard_count} shards onto the {len(devices)} pinned "
                    f"devices {list(devices)} ({_describe(ts)})"
                )
            moved[id(t)] = move_shards(t, devices)
    return moved


def place_operands(op: str, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """Apply the placement rule to an op's arguments.

    Returns the (possibly moved) arguments and whether the result must be pinned.
    """
    ts: list[ShardedTensor] = []
    for a in args:
        if isinstance(a, ShardedTensor):
            ts.append(a)
        elif isinstance(a, (list, tuple, dict)):
            _collect(a, ts)
    if kwargs:
        for a in kwargs.values():
            _collect(a, ts)
    if not ts:
        return args, kwargs, False
    devices = ts[0].devices
    pinned = True
    same = True
    for t in ts:
        pinned = pinned and t._pinned
        same = same and t._devices == devices
    if same:
        return args, kwargs, pinned
    moved = _plan(op, ts)
    return _replace(args, moved), _replace(kwargs, moved), pinned


def transfer_if_needed(*tensors: Any, op: str = "transfer_if_needed") -> tuple:
    """Apply the placement rule to ``tensors`` and return them, moved where needed.

    Sharded tensors may be given directly or inside lists, tuples and dicts; everything
    else is returned unchanged. Raises :class:`PlacementError` when the rule cannot place
    them (pinned operands on different devices, or different devices and none pinned).
    """
    out, _, _ = place_operands(op, tensors, {})
    return out


def pin_result(out: Any) -> Any:
    """Mark every sharded tensor in an op's result as pinned (no data moves)."""
    if isinstance(out, ShardedTensor):
        return out if out.pinned else out.clone(pinned=True)
    if isinstance(out, (list, tuple)):
        ys = [pin_result(y) for y in out]
        return ys if isinstance(out, list) else tuple(ys)
    return out
