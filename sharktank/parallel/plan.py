"""Parallelism plans: tensor parallel size, pipeline stages, their replicas and the paths
microbatches take through them.

A plan is small immutable data:

- ``tp``: devices per tensor-parallel group;
- ``stage_of_block``: the pipeline stage of each transformer block;
- ``replicas[s]``: the device groups (each ``tp`` devices) holding a copy of stage ``s``;
- ``paths[p][s]``: which replica of stage ``s`` a microbatch on path ``p`` uses;
- ``host_of_stage[s]``: the host running stage ``s`` when the plan spans hosts (empty: the
  plan names none). Hosts are numbered from 0 in stage order, each holds consecutive stages
  (at least one) and no device of another host.

Built from ``tp``/``pp`` (stage ``s`` on devices ``s*tp .. s*tp+tp-1``) or from placement
directives (see :mod:`sharktank.parallel.directives`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..types import split_sizes

__all__ = ["ParallelPlan", "PlanError", "contiguous_blocks"]


class PlanError(ValueError):
    """A parallelism plan or placement directive that cannot work (says what and where)."""


def contiguous_blocks(num_blocks: int, pp: int) -> tuple[int, ...]:
    """Stage of each block: contiguous runs, as even as possible (earlier stages one larger)."""
    if pp < 1:
        raise PlanError(f"pp must be >= 1, found {pp}")
    if num_blocks < pp:
        raise PlanError(f"{num_blocks} blocks cannot fill {pp} pipeline stages")
    return tuple(s for s, n in enumerate(split_sizes(num_blocks, pp)) for _ in range(n))


@dataclass(frozen=True)
class ParallelPlan:
    tp: int
    stage_of_block: tuple[int, ...]
    replicas: tuple[tuple[tuple[int, ...], ...], ...]
    paths: tuple[tuple[int, ...], ...]
    host_of_stage: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise PlanError(f"tp must be >= 1, found {self.tp}")
        pp = len(self.replicas)
        if sorted(set(self.stage_of_block)) != list(range(pp)):
            raise PlanError(f"blocks must cover stages 0..{pp - 1}, found stages {sorted(set(self.stage_of_block))}")
        if list(self.stage_of_block) != sorted(self.stage_of_block):
            raise PlanError(f"blocks must go to stages in order, found {list(self.stage_of_block)}")
        groups: dict[int, tuple[int, ...]] = {}
        for s, reps in enumerate(self.replicas):
            if not reps:
                raise PlanError(f"stage {s} has no devices")
            seen: set[int] = set()
            for g in reps:
                if len(g) != self.tp:
                    raise PlanError(f"stage {s}: device group {list(g)} is not {self.tp} devices (tp={self.tp})")
                for d in g:
                    if not isinstance(d, int) or d < 0:
                        raise PlanError(f"stage {s}: devices must be non-negative ints, found {d!r}")
                    if d in seen:
                        raise PlanError(f"stage {s} lists device {d} twice")
                    seen.add(d)
                    if groups.setdefault(d, g) != g:
                        raise PlanError(
                            f"device {d} is in group {list(groups[d])} and in group {list(g)} (stage {s}): "
                            f"tensor-parallel groups of different stages must be identical or disjoint"
                        )
        if not self.paths:
            raise PlanError("a plan needs at least one path")
        for p, path in enumerate(self.paths):
            if len(path) != pp:
                raise PlanError(f"path {p} has {len(path)} stages, the plan has {pp}")
            for s, r in enumerate(path):
                if not 0 <= r < len(self.replicas[s]):
                    raise PlanError(f"path {p} uses replica {r} of stage {s}, which has {len(self.replicas[s])}")
        if self.host_of_stage:
            self._check_hosts()

    def _check_hosts(self) -> None:
        hosts = self.host_of_stage
        if len(hosts) != self.pp:
            raise PlanError(f"host_of_stage names {len(hosts)} hosts {list(hosts)} for {self.pp} stages")
        for s, h in enumerate(hosts):
            if type(h) is not int or h not in ((hosts[s - 1], hosts[s - 1] + 1) if s else (0,)):
                after = f" after stage {s - 1} on host {hosts[s - 1]}" if s else ""
                raise PlanError(
                    f"stage {s} is on host {h!r}{after}: hosts are numbered from 0 in stage order, "
                    f"each holding consecutive stages (host of each stage: {list(hosts)})"
                )
        owner: dict[int, int] = {}
        for s, reps in enumerate(self.replicas):
            for d in (d for g in reps for d in g):
                if owner.setdefault(d, s) != s and hosts[owner[d]] != hosts[s]:
                    raise PlanError(
                        f"device {d} holds stage {owner[d]} (host {hosts[owner[d]]}) and stage {s} (host {hosts[s]}): "
                        f"a device belongs to one host"
                    )

    # --- queries ----------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return len(self.replicas)

    @property
    def device_count(self) -> int:
        return 1 + max(d for reps in self.replicas for g in reps for d in g)

    @property
    def host_count(self) -> int:
        return 1 + max(self.host_of_stage, default=0)

    def stages_of_host(self, host: int) -> range:
        """The consecutive stages ``host`` runs (every stage when the plan names no hosts)."""
        if not self.host_of_stage:
            return range(self.pp)
        first = self.host_of_stage.index(host)
        return range(first, first + self.host_of_stage.count(host))

    def on_hosts(self, hosts: int | None) -> "ParallelPlan":
        """The plan over ``hosts`` hosts (None: as it is): the hosts its stages name, which
        ``hosts`` must then match, or else ``pp/hosts`` consecutive stages a host."""
        if self.host_of_stage:
            if hosts not in (None, self.host_count):
                raise PlanError(f"--hosts {hosts}, but the placement names {self.host_count} hosts (host of each stage: {list(self.host_of_stage)})")
            return self
        if hosts in (None, 1):
            return self
        if hosts < 1 or self.pp % hosts:
            raise PlanError(f"--hosts {hosts} must divide the pipeline stages (pp={self.pp}): each host holds pp/hosts consecutive stages")
        return replace(self, host_of_stage=tuple(s * hosts // self.pp for s in range(self.pp)))

    def devices(self, stage: int, replica: int = 0) -> tuple[int, ...]:
        return self.replicas[stage][replica]

    def path_devices(self, path: int) -> list[tuple[int, ...]]:
        """The device group used at each stage by ``path``."""
        return [self.replicas[s][r] for s, r in enumerate(self.paths[path])]

    def blocks_of(self, stage: int) -> list[int]:
        return [b for b, s in enumerate(self.stage_of_block) if s == stage]

    def to_dict(self) -> dict:
        out = {
            "tp": self.tp,
            "pp": self.pp,
            "stage_of_block": list(self.stage_of_block),
            "replicas": [[list(g) for g in reps] for reps in self.replicas],
            "paths": [list(p) for p in self.paths],
        }
        if self.host_of_stage:
            out["host_of_stage"] = list(self.host_of_stage)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelPlan":
        """The plan :meth:`to_dict` wrote."""
        return cls(
            d["tp"], tuple(d["stage_of_block"]), tuple(tuple(tuple(g) for g in reps) for reps in d["replicas"]),
            tuple(tuple(p) for p in d["paths"]), tuple(d.get("host_of_stage", ())),
        )

    def describe(self) -> str:
        lines = [f"tp={self.tp} pp={self.pp} devices={self.device_count}"]
        for s, reps in enumerate(self.replicas):
            host = f" (host {self.host_of_stage[s]})" if self.host_of_stage else ""
            lines.append(f"  stage {s}: blocks {self.blocks_of(s)} on {' | '.join(str(list(g)) for g in reps)}{host}")
        for p in range(len(self.paths)):
            lines.append(f"  path {p}: " + " -> ".join(str(list(g)) for g in self.path_devices(p)))
        return "\n".join(lines)

    # --- constructors -----------------------------------------------------------------------
    @classmethod
    def from_tp_pp(cls, num_blocks: int, tp: int = 1, pp: int = 1) -> "ParallelPlan":
        """Stage ``s`` on devices ``s*tp .. s*tp+tp-1``, one replica, one path."""
        if tp < 1:
            raise PlanError(f"tp must be >= 1, found {tp}")
        stages = contiguous_blocks(num_blocks, pp)
        replicas = tuple(((tuple(range(s * tp, s * tp + tp)),)) for s in range(pp))
        return cls(tp, stages, replicas, (tuple(0 for _ in range(pp)),))

    @classmethod
    def from_groups(
        cls,
        num_blocks: int,
        tp: int,
        stage_devices: Sequence[Sequence[int]],
        path_devices: Sequence[Sequence[int]] | None = None,
        host_of_stage: Sequence[int] = (),
    ) -> "ParallelPlan":
        """From each stage's device list (replicas of ``tp`` consecutive devices), optional
        paths, each naming the first device of the group used at every stage, and optionally
        each stage's host."""
        replicas = []
        for s, devs in enumerate(stage_devices):
            devs = list(devs)
            if not devs:
                raise PlanError(f"stage {s} has no devices")
            if len(devs) % tp:
                raise PlanError(f"stage {s}: {len(devs)} devices {devs} are not a multiple of tp={tp}")
            replicas.append(tuple(tuple(devs[i : i + tp]) for i in range(0, len(devs), tp)))
        pp = len(replicas)
        if path_devices:
            paths = tuple(_path_from_devices(p, devs, replicas) for p, devs in enumerate(path_devices))
        else:
            count = max(len(r) for r in replicas)
            paths = tuple(tuple(i % len(replicas[s]) for s in range(pp)) for i in range(count))
        return cls(tp, contiguous_blocks(num_blocks, pp), tuple(replicas), paths, tuple(host_of_stage))


def _path_from_devices(p: int, devs: Sequence[int], replicas) -> tuple[int, ...]:
    devs = list(devs)
    if len(devs) != len(replicas):
        raise PlanError(f"path {p} names {len(devs)} devices {devs}; expected one per stage ({len(replicas)})")
    out = []
    for s, d in enumerate(devs):
        firsts = [g[0] for g in replicas[s]]
        if d not in firsts:
            held = " | ".join(str(list(g)) for g in replicas[s])
            raise PlanError(f"path {p} uses device {d} at stage {s}, which does not hold stage {s} (it lives on {held})")
        out.append(firsts.index(d))
    return tuple(out)
