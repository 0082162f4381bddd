"""Placement directives: the JSON format pipeline schedulers use, plus paths.

A directive list holds one ``place`` per pipeline stage and optional ``path`` directives:

- ``{"op": "place", "filter": {"PP": s}, "devices": [...]}``: the devices holding stage ``s``;
  the list is ``R`` replicas of the stage, each a group of ``tp`` consecutive devices. An
  optional ``"host": h`` (our addition) names the host running the stage, for an export over
  several hosts: every place directive names one or none does, hosts are numbered from 0 in
  stage order, each holds consecutive stages (as many as it likes) and devices no other host
  uses. Other keys (``"stream"``) are accepted and ignored.
- ``{"op": "path", "devices": [d0, d1, ...]}`` (our addition): a route for microbatches, one
  entry per stage naming the first device of the replica group used there. DualPipe's two
  directions inside a group are ``[0, 1, ..., 7]`` and ``[7, 6, ..., 0]``; DualPipeV's V is
  ``[0, 1, 2, 3, 3, 2, 1, 0]``. Without path directives, path ``r`` uses replica ``r`` of every
  stage (``r % replicas``), one path per replica.

Microbatch ``i`` takes path ``i % len(paths)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .plan import ParallelPlan, PlanError

__all__ = ["load_directives", "plan_from_directives"]


def load_directives(source: str | Path | Sequence[dict]) -> list[dict]:
    """Directives from a JSON file path, or a list of dicts (or of several files' lists)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanError(f"placement file {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"placement file {path} is not valid JSON: {e}") from None
        if not isinstance(data, list):
            raise PlanError(f"placement file {path} must hold a JSON list of directives")
        return data
    out: list[dict] = []
    for item in source:
        if isinstance(item, (str, Path)):
            out.extend(load_directives(item))
        else:
            out.append(item)
    return out


def plan_from_directives(directives: str | Path | Sequence[Any], num_blocks: int, tp: int = 1, pp: int | None = None) -> ParallelPlan:
    """Validate directives and build the plan (``pp``, when given, must match the stages)."""
    stages: dict[int, list[int]] = {}
    hosts: dict[int, Any] = {}
    paths: list[list[int]] = []
    for i, d in enumerate(load_directives(directives)):
        if not isinstance(d, dict) or "op" not in d:
            raise PlanError(f"directive {i} must be an object with an 'op', found {d!r}")
        if d["op"] == "place":
            stage = (d.get("filter") or {}).get("PP")
            if not isinstance(stage, int) or stage < 0:
                raise PlanError(f"directive {i}: place needs filter {{'PP': stage}}, found {d.get('filter')!r}")
            if stage in stages:
                raise PlanError(f"directive {i}: stage {stage} is placed twice")
            devices = d.get("devices")
            if not isinstance(devices, list) or not devices:
                raise PlanError(f"directive {i}: stage {stage} has no devices")
            stages[stage] = devices
            if "host" in d:
                hosts[stage] = d["host"]
        elif d["op"] == "path":
            devices = d.get("devices")
            if not isinstance(devices, list):
                raise PlanError(f"directive {i}: path needs a 'devices' list")
            paths.append(devices)
        else:
            raise PlanError(f"directive {i}: unknown op {d['op']!r}; expected 'place' or 'path'")
    if not stages:
        raise PlanError("placement has no 'place' directives")
    missing = [s for s in range(max(stages) + 1) if s not in stages]
    if missing:
        raise PlanError(f"placement has no place directive for stage(s) {missing}")
    if pp is not None and pp != len(stages):
        raise PlanError(f"pp={pp} but the placement has {len(stages)} stages")
    if hosts and len(hosts) != len(stages):
        named, unnamed = min(hosts), min(set(stages) - set(hosts))
        raise PlanError(
            f"stage {named} names host {hosts[named]!r} but stage {unnamed} names none: "
            f"name a host in every place directive or in none"
        )
    order = range(len(stages))
    return ParallelPlan.from_groups(num_blocks, tp, [stages[s] for s in order], paths or None, tuple(hosts[s] for s in order) if hosts else ())
