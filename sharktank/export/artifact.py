"""An export artifact directory: MLIR, compiled module, per-device parameters, manifest.

Layout of ``DIR``:

- ``model.mlir``: the multi-device program (kept so ``sharktank compile`` can recompile);
- ``model.vmfb``: the compiled module (absent after ``--no-compile``);
- ``device_{d}.irpa``: the weight shards logical device ``d`` loads (scope ``model``);
- ``tokenizer.json``: the source's tokenizer, when it has one (see :mod:`sharktank.text.tokenizer`);
- ``manifest.json``: everything needed to run it (see :func:`export_artifact`).

Everything is written into a temporary directory beside ``DIR`` and renamed into place
when complete, so a failed or interrupted export leaves the previous ``DIR`` as it was.
"""

from __future__ import annotations

import copy
import json
import platform
import re
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

from ..models.llama.model import LlamaModel
from ..parallel import ParallelPlan, PlanError
from ..text.tokenizer import export_tokenizer
from ..types import QuantizedTensor
from ..weights._files import atomic_dir, atomic_file, check_replaceable, sha256_file
from .archives import write_archives
from .cache_size import host_memory_bytes, resolve_max_seq_len
from .compile import QUANTIZED_FLAGS, TARGETS, compile_flags, compile_mlir
from .llama import SCOPE, ExportedWeights, export_llama
from .manifest import ARTIFACT_FORMAT, CONTIGUOUS_KINDS, HOST_KINDS, ArtifactError, HostsManifest, Manifest
from .program import count_transfers
from .kernels import kernels_for, kernels_in

__all__ = ["MANIFEST", "export_artifact", "write_program", "compile_artifact", "versions", "host_cpu", "transfers_per_function"]

MANIFEST = "manifest.json"
VERSION = 1


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("sharktank", "torch", "iree-turbine", "iree-base-compiler", "iree-base-runtime"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def host_cpu() -> str:
    """The host CPU model and feature flags, short: a module compiled for ``host`` runs only on
    a CPU with the same features."""
    flags = model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import hashlib

    return f"{platform.machine()} {model} [{hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def transfers_per_function(mlir: str) -> dict[str, int]:
    """``flow.tensor.transfer`` count in each program function (``func.func``) of the MLIR
    text; not in the hand-written kernels' dispatch functions (their arguments are
    ``!stream.binding``s)."""
    out = {}
    parts = re.split(r"(?=func\.func @)", mlir)
    for part in parts[1:]:
        head = re.match(r"func\.func @(\w+)\(([^)]*)", part)
        if "!stream.binding" not in head.group(2):
            out[head.group(1)] = count_transfers(part)
    return out


def _may_replace(path: Path) -> bool:
    return not any(path.iterdir()) or (path / MANIFEST).exists()


def _compile_section(mlir: str, device_count: int, target: str, target_arch: str | None, extra: tuple[str, ...]):
    t0 = time.perf_counter()
    vmfb = compile_mlir(mlir, device_count, target, target_arch, extra)
    seconds = time.perf_counter() - t0
    info = {
        "target": target,
        "target_arch": target_arch or TARGETS[target].default_arch,
        "driver": TARGETS[target].driver,
        "flags": compile_flags(device_count, target, target_arch, extra),
        "seconds": round(seconds, 3),
        "host_cpu": host_cpu() if target == "cpu" and (target_arch or "host") == "host" else None,
    }
    return vmfb, info


def checked_length(model: LlamaModel, max_seq_len: int | None, batch_sizes: tuple[int, ...], target: str, progress: Callable[[str], None]) -> int:
    """The KV-cache length to export (see :func:`export_artifact`); refuses an unknown target."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {sorted(TARGETS)}")
    max_seq_len, note = resolve_max_seq_len(
        model.config, max_seq_len, batch_sizes, model.dtype,
        weight_bytes=model.source.theta.nbytes(), memory_bytes=host_memory_bytes() if target == "cpu" else None,
    )
    progress(note)
    return max_seq_len


def check_compilable_device_count(count: int) -> None:
    """Refuse, before anything is traced, a program over an odd number (> 1) of devices.

    IREE 3.10's stream partitioning fails on the model's decode step over 3 or 5 devices
    ("op affinity #hal.device.affinity<@__device_2> is not compatible with the partition
    affinity #hal.device.affinity<@__device_0>"), whether they are tensor-parallel or pipeline
    stages, while 1, 2, 4 and 6 devices compile and equal eager."""
    if count > 1 and count % 2:
        raise PlanError(
            f"a program over {count} devices does not compile with IREE 3.10 (its stream partitioning fails on odd device "
            f"counts above 1); use an even count (e.g. --tp {count} --pp 2), or export with --no-compile to write the MLIR only"
        )


def exported_kinds(functions: Sequence[str] | None, *, hosts: int, paths: int) -> tuple[str, ...]:
    """The contiguous-cache kinds an export traces (see :func:`export_artifact`'s
    ``functions``), checked: a ValueError names an unknown kind or a missing prefill or
    decode, a PlanError a kind this plan cannot have."""
    possible = HOST_KINDS if hosts > 1 else CONTIGUOUS_KINDS if paths == 1 else tuple(k for k in CONTIGUOUS_KINDS if k != "prefill_chunk")
    if functions is None:
        return possible
    chosen = set(functions)
    unknown = chosen - set(CONTIGUOUS_KINDS)
    if unknown:
        raise ValueError(f"unknown function kinds {sorted(unknown)}: expected some of {list(CONTIGUOUS_KINDS)} (the paged ones come with a page size)")
    missing = {"prefill", "decode"} - chosen
    if missing:
        raise ValueError(f"the functions must include prefill and decode (every runner needs them), found {sorted(chosen)}")
    impossible = chosen - set(possible)
    if impossible:
        why = f"{hosts} hosts" if hosts > 1 else f"{paths} microbatch paths"
        raise PlanError(f"function kinds {sorted(impossible)} cannot be exported for a plan of {why}: it has {list(possible)}")
    return tuple(k for k in possible if k in chosen)


def export_artifact(
    model: LlamaModel,
    output_dir: str | Path,
    *,
    source: str,
    batch_sizes: tuple[int, ...] = (1,),
    max_seq_len: int | None = None,
    target: str = "cpu",
    target_arch: str | None = None,
    extra_flags: tuple[str, ...] = (),
    compile: bool = True,
    progress: Callable[[str], None] = lambda msg: None,
    hosts: int | None = None,
    page_size: int | None = None,
    functions: Sequence[str] | None = None,
    exact_prompts: bool = False,
) -> Manifest | HostsManifest:
    """Export (and compile) ``model`` into ``output_dir``; returns its manifest as read back.

    ``hosts``: the pipeline stages split over that many hosts, one program each, when the
    plan's stages name no hosts; when they do, None or their number (see
    :meth:`~sharktank.parallel.ParallelPlan.on_hosts`). Over several hosts the export is
    :mod:`sharktank.export.hosts`'s and the result its top-level manifest (format
    ``sharktank.hosts``).

    ``max_seq_len``: the KV-cache length; by default the model's context up to
    :data:`~sharktank.export.cache_size.DEFAULT_MAX_SEQ_LEN`. A length past the model's, or
    a cache that with the weights would not fit in this host's memory (CPU target), raises
    :class:`~sharktank.export.cache_size.CacheSizeError` before anything is traced.

    ``page_size``: also export the paged functions (``prefill_paged``, ``decode_paged``, see
    :func:`~sharktank.export.llama.paged_programs`) over a pool of pages of that many
    positions; a plan of one microbatch path on one host only.

    ``functions``: the contiguous-cache kinds to export, among ``prefill``, ``decode``,
    ``prefill_row``, ``prefill_rows`` and ``prefill_chunk`` (prefill and decode always
    included; over several hosts only prefill_row can be added); None: all the plan has. Each
    kind is compiled for every batch size: `run` needs only prefill and decode, `serve`
    prefill_row (batches of several rows) or prefill_chunk.

    ``exact_prompts`` (cpu target): a float32 or float16 model's prompt products with
    quantized weights keep the dense product of the dequantized weight, as eager computes
    it, instead of the prefill dispatches (about 5x faster, x and the weight rounded to
    bfloat16: :mod:`sharktank.export.kernels.prefill`). A bfloat16 model's are the same
    either way."""
    check_replaceable(Path(output_dir), _may_replace)  # before the minutes of tracing, not after
    over_hosts = model.plan.on_hosts(hosts)
    functions = exported_kinds(functions, hosts=over_hosts.host_count, paths=len(model.plan.paths))
    if page_size is not None and (over_hosts.host_count > 1 or len(model.plan.paths) != 1):
        raise PlanError(
            f"a paged cache (page size {page_size}) needs one host and one microbatch path; this plan has "
            f"{over_hosts.host_count} hosts and {len(model.plan.paths)} microbatch paths; export it without --page-size"
        )
    if page_size is not None and page_size < 1:
        raise ValueError(f"page size must be >= 1, found {page_size}")
    if over_hosts.host_count > 1:
        from .hosts import export_hosts

        export_hosts(
            model, over_hosts, output_dir, source=source, batch_sizes=tuple(batch_sizes), max_seq_len=max_seq_len, target=target,
            target_arch=target_arch, extra_flags=tuple(extra_flags), compile=compile, progress=progress, functions=functions,
            exact_prompts=exact_prompts,
        )
        return HostsManifest.read(output_dir)
    plan = model.plan
    if compile:
        check_compilable_device_count(plan.device_count)
    max_seq_len = checked_length(model, max_seq_len, tuple(batch_sizes), target, progress)
    t0 = time.perf_counter()
    paged = f" and the paged functions (pages of {page_size})" if page_size is not None else ""
    progress(f"exporting prefill and decode for batch sizes {', '.join(map(str, batch_sizes))}{paged} over {plan.device_count} devices")
    # Attention unfused for every target: IREE 3.10's fused attention op is slow on CPU
    # and does not compile for CUDA (sm_80) or HIP (gfx942) on these models.
    output, weights, specs = export_llama(
        model, tuple(batch_sizes), max_seq_len, attention_as_matmuls=True,
        cpu_kernels=kernels_for(target, target_arch, exact_prompts=exact_prompts), page_size=page_size, functions=functions,
    )
    mlir = str(output.mlir_module)
    export_seconds = time.perf_counter() - t0
    progress(f"exported in {export_seconds:.1f} s")
    with atomic_dir(output_dir, may_replace=_may_replace, marker=MANIFEST) as tmp:
        write_program(
            tmp, model, plan, mlir, weights, specs, source=source, export_seconds=export_seconds, target=target,
            target_arch=target_arch, extra_flags=tuple(extra_flags), compile=compile, progress=progress,
        )
    return Manifest.read(output_dir)  # the reader's checks also check what was written


def write_program(
    directory: Path,
    model: LlamaModel,
    plan: ParallelPlan,
    mlir: str,
    weights: ExportedWeights,
    specs: dict,
    *,
    source: str,
    export_seconds: float,
    target: str,
    target_arch: str | None,
    extra_flags: tuple[str, ...],
    compile: bool,
    progress: Callable[[str], None],
    extra: dict | None = None,
    tokenizer: bool = True,
) -> dict:
    """Write one program over ``plan``'s devices into ``directory``: ``model.mlir``, the
    per-device archives, ``model.vmfb`` (when ``compile``) and ``manifest.json`` (with
    ``extra``'s fields added), and with ``tokenizer`` the source's tokenizer; returns the manifest."""
    quantized = any(isinstance(t, QuantizedTensor) for t in model.source.theta.values())
    if quantized:
        extra_flags = (*extra_flags, *QUANTIZED_FLAGS)
    (directory / "model.mlir").write_text(mlir)
    tokens = export_tokenizer(source, directory, vocab_size=model.config.vocab_size, progress=progress) if tokenizer else None
    files = write_archives(directory, weights, progress)
    progress(f"wrote {len(files)} parameter archives ({sum(f['size'] for f in files.values()) / 1e6:.2f} MB)")
    compile_info = None
    if compile:
        progress(f"compiling for {target} ({plan.device_count} devices)")
        vmfb, compile_info = _compile_section(mlir, plan.device_count, target, target_arch, extra_flags)
        (directory / "model.vmfb").write_bytes(vmfb)
        progress(f"compiled in {compile_info['seconds']:.1f} s")
    manifest = {
        "format": ARTIFACT_FORMAT,
        "version": VERSION,
        "model": {"source": source, "config": model.config.to_dict(), "dtype": str(model.dtype).removeprefix("torch."), "quantized": quantized,
                  **model.splits()},
        "parallel": plan.to_dict(),
        "device_count": plan.device_count,
        "functions": specs,
        "transfers": transfers_per_function(mlir),
        "parameters": {"scope": SCOPE, "files": files},
        # The hand-written CPU dispatches the program calls (sharktank.export.kernels): block
        # layouts and decode_attention.
        "module": {"mlir": "model.mlir", "vmfb": "model.vmfb" if compile else None, "cpu_kernels": kernels_in(mlir)},
        "export_seconds": round(export_seconds, 3),
        "compile": compile_info,
        "versions": versions(),
        **(extra or {}),
    }
    if tokens is not None:  # see sharktank.text.load_tokenizer
        manifest["tokenizer"] = tokens
    if compile:
        manifest["module"]["vmfb_sha256"] = sha256_file(directory / "model.vmfb")
        manifest["module"]["vmfb_size"] = (directory / "model.vmfb").stat().st_size
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def compile_artifact(
    directory: str | Path,
    *,
    target: str | None = None,
    target_arch: str | None = None,
    extra_flags: tuple[str, ...] = (),
    progress: Callable[[str], None] = lambda msg: None,
) -> Manifest:
    """(Re)compile an artifact's ``model.mlir`` in place; returns the updated manifest. A
    program that calls CPU kernels (``module.cpu_kernels``) compiles only for ``cpu`` and this
    host's CPU (:class:`~sharktank.runtime.ArtifactError` for another target or arch)."""
    directory = Path(directory)
    m = Manifest.read(directory)
    manifest = copy.deepcopy(m.data)  # updated below and written back whole
    target = target or (m.compile or {}).get("target", "cpu")
    kernels = m.module.get("cpu_kernels") or []
    if kernels and target != "cpu":
        raise ArtifactError(
            f"{directory} was exported for the CPU: its program calls hand-written CPU dispatches ({', '.join(kernels)}), "
            f"which cannot be compiled for {target}; export it again with --target {target}"
        )
    if kernels and (target_arch or "host") != "host":
        raise ArtifactError(
            f"{directory} was exported for this host's CPU: its program calls hand-written CPU dispatches ({', '.join(kernels)}), "
            f"written for this CPU's instructions; export it again with --target-arch {target_arch} to compile for {target_arch}"
        )
    progress(f"compiling for {target} ({m.device_count} devices)")
    mlir = (directory / m.module["mlir"]).read_text()
    if m.quantized:
        extra_flags = (*extra_flags, *QUANTIZED_FLAGS)
    vmfb, info = _compile_section(mlir, m.device_count, target, target_arch, tuple(extra_flags))
    progress(f"compiled in {info['seconds']:.1f} s")
    with atomic_file(directory / "model.vmfb") as tmp:
        tmp.write_bytes(vmfb)
    manifest["compile"] = info
    manifest["module"].update(vmfb="model.vmfb", vmfb_sha256=sha256_file(directory / "model.vmfb"), vmfb_size=len(vmfb))
    manifest["versions"] = versions()
    with atomic_file(directory / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))
    return Manifest.read(directory)
