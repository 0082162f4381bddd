"""Exporting a pipeline over several hosts: one multi-device program per host.

The plan's ``host_of_stage`` says which consecutive stages each host runs (one device group
per stage, one path), tensor-parallel inside: as a placement file names them, or with
``--hosts H`` host ``h`` gets stages ``h*P/H .. (h+1)*P/H - 1`` of ``P``
(:meth:`~sharktank.parallel.ParallelPlan.on_hosts`). Each host's devices are numbered from
0 (in the order of their global numbers), and a host's program holds only its stages'
weights. Layout of ``DIR``:

- ``manifest.json``: format ``sharktank.hosts``: the model, the global plan, and per host its
  directory, stages, blocks, devices (global -> local) and its manifest's sha256;
- ``host_{h}/``: that host's program, laid out as a one-host artifact (``model.mlir``,
  ``model.vmfb``, ``device_{d}.irpa``, ``manifest.json`` with a ``host`` field), so
  ``sharktank compile DIR/host_{h}`` recompiles it on its own host.

What crosses a host boundary is a function argument or result. Per batch size ``B``
(``S`` dynamic in prefill, 1 in decode):

- first host: ``prefill_bs{B}(tokens[B, S], positions[B, S], *cache) -> (hidden[B, S, D], *cache)``;
- later hosts: ``(hidden[B, S, D], positions[B, S], *cache) -> (hidden | logits, *cache)``,
  the last one returning ``logits[B, S, vocab]``;
- for ``B > 1`` also ``prefill_row_bs{B}(x[1, S, ...], positions[1, S], row[1], *cache)``:
  one prompt into batch row ``row`` of the batch-``B`` cache, the other rows left as they
  were (what continuous batching admits a request with; see :mod:`sharktank.export.llama`).

``hidden`` is one copy of the residual stream (the tensor-parallel group holds it
replicated; the next host replicates it over its own group) in the model's dtype, bfloat16
as its int16 bits. ``cache`` holds only that host's blocks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.utils._pytree as pytree

from .. import ops
from ..models.llama.model import LlamaModel
from ..parallel import ParallelPlan, PlanError
from ..types import ReplicatedTensor, ShardedTensor
from ..weights._files import atomic_dir, sha256_file
from .artifact import MANIFEST, _may_replace, checked_length, versions, write_program
from .llama import cache_arg_specs, import_programs, lift_weights, row_index, row_slices, trace_program
from .kernels import CpuKernels, kernels_for
from .manifest import HOST_KINDS, HOSTS_FORMAT
from .program import arg_devices

__all__ = ["host_dir", "host_plan", "export_hosts"]



def host_dir(host: int) -> str:
    return f"host_{host}"


def host_plan(plan: ParallelPlan) -> tuple[ParallelPlan, list[dict[int, int]]]:
    """``plan`` (over hosts) with each host's devices numbered from 0, and per host ``{global: local}``."""
    if any(len(reps) != 1 for reps in plan.replicas) or len(plan.paths) != 1:
        raise PlanError(
            f"a multi-host export needs one device group per stage and one path (no replicas or path "
            f"directives); found {[len(r) for r in plan.replicas]} groups per stage and {len(plan.paths)} paths"
        )
    maps, replicas = [], []
    for h in range(plan.host_count):
        stages = plan.stages_of_host(h)
        local = {d: i for i, d in enumerate(sorted({d for s in stages for d in plan.devices(s)}))}
        maps.append(local)
        replicas += [(tuple(local[d] for d in plan.devices(s)),) for s in stages]
    return ParallelPlan(plan.tp, plan.stage_of_block, tuple(replicas), plan.paths), maps


def _one_copy(x):
    """One copy of a replicated residual stream (its first device's)."""
    return x.shards[0] if isinstance(x, ShardedTensor) else x


def _export_host(model: LlamaModel, stages: range, batch_sizes: tuple[int, ...], t: int, cpu_kernels: CpuKernels | None = None,
                 functions: tuple[str, ...] = HOST_KINDS):
    """Trace host functions of ``model`` (a host plan) for ``stages``: ``(mlir, weights, specs)``;
    ``functions``: prefill and decode, and prefill_row (for batches of several rows) when named."""
    from iree.turbine.aot import DeviceAffinity, FxProgramsBuilder

    plan, c = model.plan, model.config
    first, last = stages[0] == 0, stages[-1] == plan.pp - 1
    weights = lift_weights(model, [model.stages[s] for s in stages])
    fxb = FxProgramsBuilder(weights.module)
    home = plan.devices(stages[0])[0]
    lo = sum(len(plan.blocks_of(s)) for s in range(stages[0]))
    hi = lo + sum(len(plan.blocks_of(s)) for s in stages)
    dtype = str(model.dtype).removeprefix("torch.")
    wire = "int16 (bfloat16 bits)" if model.dtype == torch.bfloat16 else dtype
    specs: dict[str, dict] = {}
    for b in batch_sizes:
        entries = model.new_cache(b, t, placeholder=True).entries[0][lo:hi]
        leaves, spec = pytree.tree_flatten(entries)
        cache_devices = arg_devices((entries,))

        def run(module, x, positions, mine, window=None):
            held = module.stages()
            if first:
                h = model.embed(x, home, held[0][0])
            else:
                x = x.view(torch.bfloat16) if model.dtype == torch.bfloat16 else x
                h = ops.replicate(ReplicatedTensor(ts=[x], devices=(home,)), devices=held[0][0].devices)
            h, new = model.forward_stages(h, positions, home, mine, 0, held, first=stages[0], window=window)
            out = model.head(h, held[-1][0]) if last else _one_copy(h)
            if out.dtype == torch.bfloat16:
                out = out.view(torch.int16)  # numpy-based runtimes cannot read bf16: pass the bits
            return out, new

        def decode(module, x, positions, *cache_leaves):
            out, new = run(module, x, positions, pytree.tree_unflatten(list(cache_leaves), spec))
            return (out, *pytree.tree_leaves(new))

        def prefill(module, x, positions, *cache_leaves):
            # A prompt from position 0 attends over its own S cache entries (export.llama).
            out, new = run(module, x, positions, pytree.tree_unflatten(list(cache_leaves), spec), window=positions.shape[1])
            return (out, *pytree.tree_leaves(new))

        def forward_row(module, x, positions, row, *cache_leaves):
            # One prompt into batch row `row`: that row of every cache entry runs as a batch of
            # one from zeros (as in export.llama._prefill_row) and is written back; no other
            # row is read or written.
            mine = pytree.tree_unflatten(list(cache_leaves), spec)
            row_on = row_index(row, home)
            old = row_slices(mine, lambda e: row_on(e.devices), fresh=True)
            out, new = run(module, x, positions, old, window=positions.shape[1])
            new = [tuple(ops.index_put(e, [row_on(e.devices)], n) for e, n in zip(kv, nkv)) for kv, nkv in zip(mine, new)]
            return (out, *pytree.tree_leaves(new))

        # prefill_row_bs1 would be prefill_bs1: exported only for batches of several rows.
        for kind, seq in (("prefill", 8), ("decode", 1)) + ((("prefill_row", 8),) if b > 1 and "prefill_row" in functions else ()):
            name = f"{kind}_bs{b}"
            rows_in = 1 if kind == "prefill_row" else b
            s_dim = 1 if kind == "decode" else "S"
            positions = torch.arange(seq)[None, :].expand(rows_in, seq).clone()
            if first:
                x = torch.zeros(rows_in, seq, dtype=torch.int64)
                x_spec = {"name": "tokens", "shape": [rows_in, s_dim], "dtype": "int64", "device": home}
            else:
                x = torch.zeros(rows_in, seq, c.hidden_size, dtype=torch.int16 if model.dtype == torch.bfloat16 else model.dtype)
                x_spec = {"name": "hidden", "shape": [rows_in, s_dim, c.hidden_size], "dtype": wire, "device": home}
            named = [x_spec, {"name": "positions", "shape": [rows_in, s_dim], "dtype": "int64", "device": home}]
            args = [x, positions]
            if kind == "prefill_row":
                named.append({"name": "row", "shape": [1], "dtype": "int64", "device": home})
                args.append(torch.zeros(1, dtype=torch.int64))
            dynamic = None
            if kind != "decode":
                s = torch.export.Dim("seq_len", min=2, max=t)
                dynamic = ({1: s}, {1: s}, *([None] if kind == "prefill_row" else []), tuple([None] * len(leaves)))
            arg_device = {i: DeviceAffinity(d) for i, d in enumerate([home] * len(named) + cache_devices)}
            fn = {"prefill": prefill, "decode": decode, "prefill_row": forward_row}[kind]
            trace_program(fxb, fn, (*args, *leaves), name=name, arg_device=arg_device, dynamic=dynamic, attention_as_matmuls=True, cpu_kernels=cpu_kernels)
            width = c.vocab_size if last else c.hidden_size
            out = {"name": "logits" if last else "hidden", "shape": [rows_in, s_dim, width], "dtype": wire}
            specs[name] = {
                "batch_size": b,
                "args": [*named, *cache_arg_specs(leaves, cache_devices)],
                "results": [out] + [{"name": f"cache.{i}", "same_as_arg": len(named) + i} for i in range(len(leaves))],
                "cache": {"paths": [0], "rows": [[0, b]], "max_seq_len": t},
            }
    return str(import_programs(fxb).mlir_module), weights, specs


def export_hosts(
    model: LlamaModel,
    plan: ParallelPlan,
    output_dir: str | Path,
    *,
    source: str,
    batch_sizes: tuple[int, ...],
    max_seq_len: int | None,
    target: str,
    target_arch: str | None,
    extra_flags: tuple[str, ...],
    compile: bool,
    progress: Callable[[str], None],
    functions: tuple[str, ...] = HOST_KINDS,
    exact_prompts: bool = False,
) -> dict:
    """``export_artifact`` (which has the defaults) of a plan over several hosts: ``model``'s
    pipeline split as ``plan`` (``model.plan`` with ``host_of_stage``) says into
    ``output_dir`` (see the module docstring); returns the top-level manifest."""
    local, maps = host_plan(plan)
    t = checked_length(model, max_seq_len, tuple(batch_sizes), target, progress)
    hm = LlamaModel(model.config, model.source.theta, local, source=model.source)
    hosts = plan.host_count
    t0 = time.perf_counter()
    entries = []
    with atomic_dir(output_dir, may_replace=_may_replace, marker=MANIFEST) as tmp:
        for h in range(hosts):
            stages = plan.stages_of_host(h)
            progress(f"host {h}: exporting stages {list(stages)} over {len(maps[h])} devices")
            t1 = time.perf_counter()
            mlir, weights, specs = _export_host(hm, stages, tuple(batch_sizes), t, cpu_kernels=kernels_for(target, target_arch, exact_prompts=exact_prompts), functions=functions)
            sub = tmp / host_dir(h)
            sub.mkdir()
            role = {"host": h, "hosts": hosts, "stages": list(stages), "first": h == 0, "last": h == hosts - 1}
            host_manifest = write_program(
                sub, hm, _host_only(local, stages), mlir, weights, specs, source=source, export_seconds=time.perf_counter() - t1,
                target=target, target_arch=target_arch, extra_flags=tuple(extra_flags), compile=compile, progress=progress,
                extra={"host": role}, tokenizer=h == 0,  # rank 0 owns the text
            )
            entries.append({
                **role,
                "dir": host_dir(h),
                "blocks": [b for s in stages for b in local.blocks_of(s)],
                "devices": sorted([g, l] for g, l in maps[h].items()),
                "device_count": host_manifest["device_count"],
                "transfers": host_manifest["transfers"],
                "manifest_sha256": sha256_file(sub / MANIFEST),
            })
        manifest = {
            "format": HOSTS_FORMAT,
            "version": 1,
            "model": {"source": source, "config": model.config.to_dict(), "dtype": str(model.dtype).removeprefix("torch."),
                      **model.splits()},
            "parallel": plan.to_dict(),
            "hosts": entries,
            "boundary": {"hidden_size": model.config.hidden_size, "dtype": str(model.dtype).removeprefix("torch."), "batch_sizes": list(batch_sizes)},
            "export_seconds": round(time.perf_counter() - t0, 3),
            "versions": versions(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _host_only(plan: ParallelPlan, stages: range) -> ParallelPlan:
    """The part of a host plan one host runs: its stages (and its blocks) only."""
    blocks = [b for s in stages for b in plan.blocks_of(s)]
    return ParallelPlan(
        plan.tp,
        tuple(plan.stage_of_block[b] - stages[0] for b in blocks),
        tuple(plan.replicas[s] for s in stages),
        (tuple(plan.paths[0][s] for s in stages),),
    )
