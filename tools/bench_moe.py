"""Mixture-of-experts decode and prefill against their limits, side by side in one run.

    python tools/bench_moe.py [--dtypes float32,bfloat16,q8_0] [--rounds 3] [--layers 4] [--hidden 1024]
                              [--steps 16] [--prompt 128] [--batch 1] [--json FILE]

Four checkpoints with random weights (transformers' classes, float32, cached under
``~/.cache/sharktank/moe``): a Mixtral-shaped model (8 experts, top 2), a Qwen3-MoE-shaped one
(64 experts, top 8) and each one's dense twin with the same total FFN bytes (ffn = E * expert
ffn): a Llama for Mixtral, a Qwen3 (q/k norms, as Qwen3-MoE's attention has) for Qwen3-MoE,
each FFN (and expert) ``--hidden / 1024`` times as wide as these at hidden 1024,
each exported for the CPU (``prefill``, ``decode``) in each of ``--dtypes`` (``float32``;
``bfloat16``, the weights converted at export; ``q8_0``, a GGUF of Q8_0 weights and experts
written by ``sharktank quantize``, routers and norms float32; exported again when the
checkout's commit changes) and timed in interleaved rounds:

- decode ms/token (batch 1; ``--batch B``: ms per step of B sequences) against the *active-bytes* limit: the weights a step reads
  (dense ones, the router, the LM head, and ``top_k / E`` of the experts) over this machine's
  read bandwidth (``bench_limits.read_bandwidth_gbs``); target <= 1.3x;
- decode against its dense twin: target faster by >= 0.6 * E / top_k;
- prefill of ``--prompt`` tokens against the dense twin (which computes what an
  every-expert-over-every-token prefill computes);
- bytes crossing devices per decode token at ep 1, 2 and 4, with tensor-parallel attention
  over the same devices (tp = ep) and alone (tp 1: attention replicated), eager
  (``ops.record_transfers``), next to a ring all-reduce's for the same collectives (the
  minimum for combining partial sums held on every device).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_limits import read_bandwidth_gbs  # noqa: E402

HEADS, KV_HEADS, VOCAB = 16, 4, 4096
SHAPES = {
    # name: (class, experts, top_k, ffn per expert at hidden 1024)
    "mixtral_8x2": ("mixtral", 8, 2, 1536),
    "qwen3moe_64x8": ("qwen3_moe", 64, 8, 192),
    "dense_same_bytes": ("llama", 1, 1, 8 * 1536),
    "dense_qwen3_same_bytes": ("qwen3", 1, 1, 64 * 192),
}
# Each model's dense twin (the same attention, an FFN of the same total bytes): what "dense /
# this" divides by. Qwen3's attention normalizes q and k per head, Llama's does not.
DENSE_TWIN = {"mixtral_8x2": "dense_same_bytes", "qwen3moe_64x8": "dense_qwen3_same_bytes",
              "dense_same_bytes": "dense_same_bytes", "dense_qwen3_same_bytes": "dense_qwen3_same_bytes"}


def _config(kind: str, experts: int, top_k: int, ffn: int, layers: int, hidden: int):
    common = dict(hidden_size=hidden, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=layers,
                  vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")
    if kind == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=top_k, **common)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(moe_intermediate_size=ffn, intermediate_size=ffn, num_experts=experts, num_experts_per_tok=top_k,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=hidden // HEADS, **common)
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(intermediate_size=ffn, head_dim=hidden // HEADS, **common)
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=ffn, **common)


def checkpoint(name: str, layers: int, hidden: int = 1024) -> Path:
    """The cached checkpoint of ``name`` (made once, random weights, seed 0)."""
    path = Path.home() / ".cache" / "sharktank" / "moe" / (f"{name}-l{layers}" + (f"-h{hidden}" if hidden != 1024 else ""))
    if not (path / "config.json").exists():
        import transformers

        kind, experts, top_k, ffn = SHAPES[name]
        config = _config(kind, experts, top_k, ffn * hidden // 1024, layers, hidden)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        with torch.no_grad():  # a sharp router: top-k choices far from ties, as trained ones are
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight") and p.shape[0] == experts:
                    p.mul_(8)
        model.save_pretrained(path)
    return path


def active_bytes(name: str, ckpt: Path, dtype: torch.dtype | None) -> tuple[int, int]:
    """(bytes a batch-1 decode step reads, total weight bytes) of the weights as exported
    (``source`` in ``dtype``): the embedding table counts one row; stacked or per-expert
    tensors count ``top_k / E`` of their bytes."""
    from sharktank.models.loading import weight_source
    from sharktank.types import QuantizedTensor

    _, experts, top_k, _ = SHAPES[name]
    _, weights = weight_source(ckpt)
    if dtype is not None:
        weights = weights.to(dtype)
    active = total = 0
    for key, t in weights.theta.items():
        data = t.blocks if isinstance(t, QuantizedTensor) else t
        n = data.numel() * data.element_size()
        total += n
        if "embed_tokens" in key:
            active += n // t.shape[0]
        elif ".experts." in key:
            active += n * top_k // experts
        else:
            active += n
    return active, total


DTYPES = ("float32", "bfloat16", "q8_0")


def source(name: str, layers: int, kind: str, hidden: int = 1024) -> tuple[Path, torch.dtype | None]:
    """The weights of ``name`` in ``kind`` (one of :data:`DTYPES`): a source and the dtype
    its export converts to (a Q8_0 GGUF made once from the checkpoint)."""
    ckpt = checkpoint(name, layers, hidden)
    if kind == "q8_0":
        gguf = ckpt.parent / f"{ckpt.name}-q8_0.gguf"
        if not gguf.exists():
            from sharktank.models import quantize_gguf
            from sharktank.models.loading import weight_source

            config, weights = weight_source(ckpt)
            quantize_gguf(gguf, config, weights, to="q8_0")
        return gguf, None
    return ckpt, getattr(torch, kind)


def artifact(name: str, layers: int, max_seq_len: int, kind: str, batch: int = 1, hidden: int = 1024) -> Path:
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    src, dtype = source(name, layers, kind, hidden)
    ckpt = checkpoint(name, layers, hidden)
    out = ckpt.parent / (f"{ckpt.name}-{kind}-art{max_seq_len}" + (f"-bs{batch}" if batch > 1 else ""))
    # Exported again when the checkout's commit is another than the one that exported it.
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True).stdout.strip()
    made = out / "bench_commit.txt"
    if not (out / "manifest.json").exists() or not made.exists() or made.read_text() != commit:
        print(f"exporting {name} {kind} at {commit[:7] or 'an unknown commit'} ...", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        export_artifact(load_model(src, deferred=True, dtype=dtype), out, source=str(src), max_seq_len=max_seq_len,
                        functions=("prefill", "decode"), batch_sizes=(batch,))
        made.write_text(commit)
    return out


def _times(model, prompt: torch.Tensor, steps: int) -> dict:
    t0 = time.perf_counter()
    logits, _ = model.prefill(prompt, logits="last")
    logits[:, -1].argmax(-1).tolist()
    prefill = time.perf_counter() - t0
    _, cache = model.prefill(prompt[:, :8], logits="last")
    decode = []
    for i in range(steps):
        pos = 8 + i
        t0 = time.perf_counter()
        logits, cache = model.decode(prompt[:, pos], cache, torch.full((prompt.shape[0],), pos))
        logits[:, -1].argmax(-1).tolist()
        if i:
            decode.append(time.perf_counter() - t0)
    return {"prefill_ms": prefill * 1e3, "decode_ms": statistics.median(decode) * 1e3}


def transfer_bytes(name: str, layers: int, ep: int, hidden: int = 1024, alone: bool = False) -> dict:
    """Bytes crossing devices in one eager batch-1 decode step at tp = ep (``alone``: tp 1,
    attention replicated), and a ring all-reduce's bytes for the same collectives (2 (N-1) /
    N of each reduced tensor sent by each of the N devices)."""
    from sharktank import ops
    from sharktank.models import load_model

    model = load_model(checkpoint(name, layers, hidden), tp=1 if alone else ep, ep=ep)
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, 32)
    model.prefill(tokens[:, :8], cache)
    with ops.record_transfers() as log:
        model.decode(tokens[:, 8:], cache, torch.tensor([8]))
    # Per block: the attention output (tp = ep only) and the experts' output, [1, hidden] float32 each.
    ring = layers * (1 if alone else 2) * 2 * (ep - 1) * hidden * 4
    return {"ep": ep, "attention": "replicated" if alone else "tp", "bytes_per_token": log.total_bytes(), "ring_all_reduce_bytes_per_token": ring, "transfers": len(log)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)} (default: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024); the FFNs and experts widen with it")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1); above 1 the limit columns are the batch-1 "
                   "active bytes (a batch's steps read the experts its tokens chose: up to all of them)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    kinds = [k for k in args.dtypes.split(",") if k]
    if not kinds or any(k not in DTYPES for k in kinds):
        p.error(f"--dtypes: expected some of {', '.join(DTYPES)}, found {args.dtypes!r}")

    from sharktank.runtime import CompiledModel

    max_seq_len = max(256, args.prompt + 8)
    keys = [(n, k) for k in kinds for n in SHAPES]
    models = {key: CompiledModel(artifact(key[0], args.layers, max_seq_len, key[1], args.batch, args.hidden)) for key in keys}
    prompt = torch.randint(0, VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in keys}
    bandwidth = []
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth_gbs(rounds=3)["median"])
        for key, m in models.items():
            runs[key].append(_times(m, prompt, args.steps))
            print(f"round {r + 1}/{args.rounds} {key[0]} {key[1]}: decode {runs[key][-1]['decode_ms']:.2f} ms, "
                  f"prefill {runs[key][-1]['prefill_ms']:.0f} ms", flush=True)
    gbs = statistics.median(bandwidth)
    rows = {}
    for n, k in keys:
        dense = statistics.median(x["decode_ms"] for x in runs[DENSE_TWIN[n], k])
        dense_prefill = statistics.median(x["prefill_ms"] for x in runs[DENSE_TWIN[n], k])
        src, dtype = source(n, args.layers, k, args.hidden)
        act, total = active_bytes(n, src, dtype)
        dec = [x["decode_ms"] for x in runs[n, k]]
        pre = [x["prefill_ms"] for x in runs[n, k]]
        limit = act / (gbs * 1e9) * 1e3
        _, experts, top_k, _ = SHAPES[n]
        rows[f"{n} {k}"] = {
            "model": n, "weights": k,
            "decode_ms": statistics.median(dec), "decode_range": [min(dec), max(dec)], "prefill_ms": statistics.median(pre),
            "prefill_range": [min(pre), max(pre)], "active_bytes": act, "total_bytes": total, "active_limit_ms": limit,
            "decode_vs_limit": statistics.median(dec) / limit, "dense_over_this_decode": dense / statistics.median(dec),
            "target_dense_over_this": 0.6 * experts / top_k if experts > 1 else None,
            "dense_over_this_prefill": dense_prefill / statistics.median(pre),
        }
    moves = [transfer_bytes("mixtral_8x2", args.layers, ep, args.hidden, alone) for alone in (False, True) for ep in (1, 2, 4) if not (alone and ep == 1)]
    print(f"\nread bandwidth {gbs:.1f} GB/s; {args.layers} layers, hidden {args.hidden}, batch {args.batch}, {args.rounds} interleaved rounds (median)")
    print("| model | weights | decode ms | active-bytes limit ms | ratio (target <= 1.3) | dense decode / this (target) | prefill ms | dense prefill / this |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows.values():
        t = f"{x['target_dense_over_this']:.1f}" if x["target_dense_over_this"] else "-"
        print(f"| {x['model']} | {x['weights']} | {x['decode_ms']:.2f} ({x['decode_range'][0]:.2f}-{x['decode_range'][1]:.2f}) | "
              f"{x['active_limit_ms']:.2f} | {x['decode_vs_limit']:.2f} | {x['dense_over_this_decode']:.2f} ({t}) | "
              f"{x['prefill_ms']:.0f} | {x['dense_over_this_prefill']:.2f} |")
    print("\n| ep | attention | transfers per decode step | bytes per token | ring all-reduce bytes per token |")
    print("|---|---|---|---|---|")
    for m in moves:
        print(f"| {m['ep']} | {m['attention']} | {m['transfers']} | {m['bytes_per_token']:.0f} | {m['ring_all_reduce_bytes_per_token']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gbs": gbs, "batch": args.batch, "rows": rows, "transfers": moves,
                                         "runs": {f"{n} {k}": v for (n, k), v in runs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
