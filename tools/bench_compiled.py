"""Harness rows for compiled modules (see ``tools/bench.py``): the toy Llama exported and
compiled for the CPU at tp1 (one device), tp2, pp2 and tp2xpp2, timed against eager
torch and against each other in the same run, plus export and compile times and the data
each decode step moves (from the exported MLIR).

On CPU every logical ``local-task`` device shares one worker pool, so a sharded module is
compared with the one-device module to measure the cost of sharding, not a speed-up. The
one-device and tp2xpp2 modules also run on ``local-sync`` (``*_sync`` rows).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Callable

import torch

from bench_mlir import mlir_transfers
from bench_timing import interleaved, ratio_stats

__all__ = ["CONFIGS", "build_artifacts", "compiled_rows"]

MODEL = "toy-llama"
CONFIGS: dict[str, tuple[int, int]] = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


def build_artifacts(root: Path, names: list[str], max_seq_len: int, progress: Callable[[str], None] = print) -> dict[str, dict]:
    """Export and compile each config into ``root/NAME`` (an artifact that loads is reused);
    returns each manifest with ``reused`` set."""
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model
    from sharktank.runtime import ArtifactError, CompiledModel

    out = {}
    for name in names:
        tp, pp = CONFIGS[name]
        directory = root / name
        try:
            CompiledModel(directory)
            manifest = json.loads((directory / "manifest.json").read_text())
            manifest["reused"] = True
        except ArtifactError:
            progress(f"exporting and compiling {MODEL} {name} into {directory}")
            manifest = export_artifact(load_model(MODEL, tp=tp, pp=pp), directory, source=MODEL, max_seq_len=max_seq_len).data
            manifest["reused"] = False
        out[name] = manifest
    return out


def _dispatches(mlir: str, device_count: int, function: str) -> int:
    """``flow.dispatch`` ops in ``function`` after IREE's flow-level compilation: the kernels
    one call launches (on CPU every device's run on one shared worker pool)."""
    import iree.compiler as ic
    from sharktank.export import compile_flags

    flow = ic.compile_str(mlir, extra_args=compile_flags(device_count) + ["--compile-to=flow"]).decode()
    body = next(p for p in re.split(r"(?=util\.func public @)", flow) if p.startswith(f"util.func public @{function}$async"))
    return len(re.findall(r"\bflow\.dispatch @", body))


def _decode_moves(directory: Path, device_count: int) -> dict:
    mlir = (directory / "model.mlir").read_text()
    log = mlir_transfers(mlir)["decode_bs1"]
    devices = sorted({t.dst for t in log})
    return {
        "transfers": len(log),
        "bytes": sum(t.nbytes for t in log),
        "max_sent_per_device": max((log.bytes_sent(d) for d in devices), default=0),
        "dispatches": _dispatches(mlir, device_count, "decode_bs1"),
    }


def compiled_rows(root: Path, names: list[str], rounds: int, prompt_len: int = 32, max_seq_len: int = 128) -> dict:
    """Compiled vs eager on one device, each sharded config vs one device compiled,
    export/compile seconds and decode data movement."""
    from sharktank.models import load_model
    from sharktank.runtime import CompiledModel

    manifests = build_artifacts(root, ["tp1", *[n for n in names if n != "tp1"]], max_seq_len)
    eager = load_model(MODEL, tp=1, pp=1)
    models = {name: CompiledModel(root / name) for name in manifests}
    # One device and tp2xpp2 also on the local-sync driver (every dispatch on the calling
    # thread): the cost of sharding without the worker pool's hand-offs.
    models |= {f"{n}_sync": CompiledModel(root / n, driver="local-sync") for n in ("tp1", "tp2pp2") if n in manifests}
    tokens = torch.randint(0, eager.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([prompt_len])
    with torch.no_grad():
        eager_cache = eager.new_cache(1, max_seq_len)
        reference = eager.prefill(tokens, eager_cache)
        nxt = reference[:, -1].argmax(-1)
        reference_step = eager.decode(nxt, eager_cache, pos)

    state = {}
    check = {}
    for name, m in models.items():
        logits, cache = m.prefill(tokens)
        step, _ = m.decode(nxt, cache, pos)
        state[name] = (m, m.new_cache(1), cache)
        check[name] = max(float((logits - reference).abs().max()), float((step - reference_step).abs().max()))

    def eager_decode():
        with torch.no_grad():
            eager.decode(nxt, eager_cache, pos)

    def eager_prefill():
        with torch.no_grad():
            eager.prefill(tokens, eager.new_cache(1, max_seq_len))

    decode_fns = {"eager": eager_decode} | {n: (lambda m=m, c=c: m.decode(nxt, c, pos)) for n, (m, _, c) in state.items()}
    prefill_fns = {"eager": eager_prefill} | {n: (lambda m=m, c=c: m.prefill(tokens, c)) for n, (m, c, _) in state.items()}
    decode = interleaved(decode_fns, rounds, inner=10)
    prefill = interleaved(prefill_fns, rounds, inner=3)

    rows: dict = {"model": MODEL, "prompt_len": prompt_len, "max_seq_len": max_seq_len, "max_abs_diff_vs_eager": check}
    # Speed-ups of the one-device compiled module over eager torch (eager time / compiled time).
    rows["decode_speedup_vs_eager"] = ratio_stats(decode["eager"], decode["tp1"])
    rows["prefill_speedup_vs_eager"] = ratio_stats(prefill["eager"], prefill["tp1"])
    rows["prefill_tokens_per_s"] = {k: prompt_len / statistics.median(v) for k, v in prefill.items()}
    rows["decode_ms_per_token"] = {k: statistics.median(v) * 1e3 for k, v in decode.items()}
    # Sharded compiled time / one-device compiled time.
    # (a *_sync row against tp1 on local-sync too).
    base = {n: "tp1_sync" if n.endswith("_sync") else "tp1" for n in models}
    rows["sharded_vs_tp1"] = {
        n: {"decode": ratio_stats(decode[n], decode[base[n]]), "prefill": ratio_stats(prefill[n], prefill[base[n]])}
        for n in models
        if not n.startswith("tp1")
    }
    rows["build"] = {
        n: {
            "devices": m["device_count"],
            "export_s": m["export_seconds"],
            "compile_s": m["compile"]["seconds"],
            "reused": m["reused"],
            "decode_moves": _decode_moves(root / n, m["device_count"]),
        }
        for n, m in manifests.items()
    }
    return rows
