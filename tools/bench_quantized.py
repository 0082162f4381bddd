"""Quantized weights at real size: the Llama-3.2-1B shape in bfloat16, Q8_0 and a Q4_K_M-like
mix, side by side in one run.

    python tools/bench_quantized.py [--tp 1,2] [--rounds 3] [--steps 16] [--work DIR] [--json FILE]

Per precision and tensor-parallel size: parameter bytes (and the GGUF's tensor bytes), run
peak RSS, decode ms/token, and the memory-read limit of each (the weight bytes one decode step
reads / this machine's read bandwidth, measured in the same rounds). The artifacts' decode
runs are interleaved round by round with each other and with the bandwidth measurement.

- bfloat16: ``tools/make_checkpoint.py``'s cached checkpoint (random weights, published shape).
- Q8_0: that checkpoint through ``sharktank quantize --to q8_0`` (the gguf package's quantizer).
- Q4_K mix: the gguf package has no K-quant quantizer, so this file is made here with valid
  K-quant blocks of random bytes (scales set to 2**-10 so that values stay small): Q4_K for
  every weight but the value projections and the (tied) embedding / output table, which are
  Q6_K, as llama.cpp's Q4_K_M keeps its most sensitive tensors. Its values approximate nothing;
  it measures bytes and speed only (accuracy per type is ``tools/quantized_table.py``'s job).

Targets (issue 14): Q8_0 decode >= 1.7x faster than bfloat16 and the Q4_K mix >= 2.5x, each
within 1.2x of its own byte limit; parameter archives within 1.05x of the GGUF tensor bytes.
GGUFs and artifacts are cached outside the repo (``~/.cache/sharktank``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_limits import read_bandwidth_gbs  # noqa: E402
from bench_scale import build, row, run_once, sharktank, stats  # noqa: E402
from make_checkpoint import cache_root, cached_checkpoint  # noqa: E402

SHAPE = "llama-3.2-1b"
PRECISIONS = ("bfloat16", "q8_0", "q4_k_mix")
TARGET_SPEEDUP = {"q8_0": 1.7, "q4_k_mix": 2.5}


def q8_0_gguf(checkpoint: Path, out: Path) -> Path:
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(sharktank("quantize", "--to", "q8_0", str(checkpoint), str(out)), check=True)
    return out


def _random_blocks(layout, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid ``layout`` blocks for a ``[rows, cols]`` weight: random bytes, float16 scales 2**-10."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, cols // layout.block_size, layout.block_bytes), dtype=torch.uint8, generator=g)
    scale = torch.full(b.shape[:2], 2.0**-10, dtype=torch.float16).view(torch.uint8).reshape(*b.shape[:2], 2)
    for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[layout.name]:  # d (and dmin) of each block
        b[..., at : at + 2] = scale
    return b.reshape(rows, -1).numpy()


def q4_k_mix_gguf(checkpoint: Path, out: Path) -> Path:
    """The Q4_K_M-like file described above (norms float32), written tensor by tensor."""
    if out.is_file():
        return out
    from sharktank.models.loading import weight_source
    from sharktank.types import LAYOUTS
    from sharktank.models.llama.gguf_files import write_entries
    from sharktank.models.llama.gguf_names import to_gguf_name
    from sharktank.weights.gguf_write import tensor_array

    config, source = weight_source(checkpoint)
    entries = []
    for i, name in enumerate(source.names()):
        t = source.theta[name]
        if t.ndim == 2:
            kind = "Q6_K" if ("v_proj" in name or "embed_tokens" in name or name == "lm_head.weight") else "Q4_K"
            layout = LAYOUTS[kind]
            nbytes = t.shape[0] * t.shape[1] // layout.block_size * layout.block_bytes
            spec = ((t.shape[0], nbytes // t.shape[0]), np.uint8, nbytes, kind)
            entries.append((to_gguf_name(name), spec, lambda t=t, layout=layout, i=i: _random_blocks(layout, t.shape[0], t.shape[1], i)))
        else:
            spec = (tuple(t.shape), np.float32, t.numel() * 4, "F32")
            entries.append((to_gguf_name(name), spec, lambda name=name: tensor_array(source.read(name).float())))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_entries(out, config, entries)
    return out


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=16, help="decode tokens per round (default 16)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated subset of {','.join(PRECISIONS)}")
    parser.add_argument("--work", type=Path, default=None, help="where GGUFs and artifacts go (default: the cache dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    args = parser.parse_args(argv)
    tps = [int(x) for x in args.tp.split(",")]
    precisions = args.precisions.split(",")
    work = args.work or cache_root() / "bench-quantized"
    checkpoint = cached_checkpoint(SHAPE, "bfloat16")
    models = {"bfloat16": checkpoint}
    if "q8_0" in precisions:
        models["q8_0"] = q8_0_gguf(checkpoint, work / "llama-3.2-1b-q8_0.gguf")
    if "q4_k_mix" in precisions:
        models["q4_k_mix"] = q4_k_mix_gguf(checkpoint, work / "llama-3.2-1b-q4_k_mix.gguf")
    file_bytes = {p: (gguf_tensor_bytes(m) if m.suffix == ".gguf" else sum(f.stat().st_size for f in m.glob("*.safetensors"))) for p, m in models.items() if p in precisions}
    print(f"== quantized: {SHAPE} ({checkpoint}); precisions {precisions}, tp {tps}")
    keys = [(p, tp) for p in precisions for tp in tps]
    # Each artifact afresh (one from older code would measure that code), bfloat16 activations.
    built = {k: build(models[k[0]], work / f"{k[0]}-tp{k[1]}", k[1], args.max_seq_len, ("--dtype", "bfloat16")) for k in keys}
    for k in keys:  # the first run hashes the archives (verification record); not timed
        run_once(work / f"{k[0]}-tp{k[1]}", 1)
    decode = {k: [] for k in keys}
    peak = {k: [] for k in keys}
    bandwidth = []
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth_gbs(rounds=3)["median"])
        for k in keys:
            result, _, p = run_once(work / f"{k[0]}-tp{k[1]}", args.steps + 1)
            decode[k].append(result["decode_ms_per_token"]["median"])
            peak[k].append(p)
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{p} tp{tp} {decode[(p, tp)][-1]:.1f}" for p, tp in keys) + f" ms/token; bandwidth {bandwidth[-1]:.2f} GB/s", flush=True)
    bw = stats(bandwidth)
    print(f"  read bandwidth {bw['median']:.2f} GB/s (min {bw['min']:.2f}, max {bw['max']:.2f})")
    gib = 2**30
    rows = {}
    for p, tp in keys:
        d = stats(decode[(p, tp)])
        # A decode step reads every weight once: the tp1 archives' bytes (the tied table once).
        token_bytes = built[(p, 1)]["parameter_bytes"] if (p, 1) in built else built[(p, tp)]["parameter_bytes"]
        limit_ms = token_bytes / (bw["median"] * 1e9) * 1e3
        b = built[(p, tp)]["parameter_bytes"]
        print(f"-- {p} tp{tp}: decode {d['median']:.1f} ms/token (min {d['min']:.1f}, max {d['max']:.1f}); reads {token_bytes / 1e9:.3f} GB/token, limit {limit_ms:.1f} ms")
        r = [
            row("parameter bytes, GB", b / 1e9, "GB"),
            row("run peak RSS, GiB", max(peak[(p, tp)]) / gib, "GiB", note=f"({max(peak[(p, tp)]) / b:.2f}x the parameter bytes)"),
            row("decode ms/token (median)", d["median"], "ms"),
            row("decode / own memory-read limit", d["median"] / limit_ms, "x", 1.2 if p != "bfloat16" else None),
        ]
        if p != "bfloat16" and tp == 1:
            r.append(row("parameter bytes (tp1) / GGUF tensor bytes", b / file_bytes[p], "x", 1.05))
        if p != "bfloat16" and ("bfloat16", tp) in decode:
            r.append(row("bfloat16 decode / this decode (same rounds)", statistics.median(decode[("bfloat16", tp)]) / d["median"], "x", TARGET_SPEEDUP[p], at_most=False))
        rows[f"{p}-tp{tp}"] = r
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": bw, "decode": {f"{p}-tp{tp}": v for (p, tp), v in decode.items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
