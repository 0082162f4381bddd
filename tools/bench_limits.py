"""The limits a scale benchmark is measured against, in the same run: this machine's memory
read bandwidth, transformers' eager decode time, and the weight bytes a decode step reads.

    python tools/bench_limits.py --checkpoint DIR [--threads N] [--rounds 3] [--steps 16] [--json FILE]

A decode step of a batch-1 Llama reads every weight once, so ``weight bytes / bandwidth`` is
the floor of its time on this machine; the table prints it beside transformers' figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from sharktank.models.llama.config import LlamaConfig
from sharktank.models.llama.layout import llama_shapes

__all__ = ["read_bandwidth_gbs", "transformers_decode_ms", "weight_bytes_per_token", "main"]


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[int]:
    """torch's intra-op threads set to ``n`` (default: every core) for the block."""
    before = torch.get_num_threads()
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def read_bandwidth_gbs(nbytes: int = 1 << 30, rounds: int = 7, threads: int | None = None) -> dict[str, Any]:
    """Memory read bandwidth in GB/s (1e9 bytes/s): a float32 buffer of ``nbytes`` summed by torch.

    The buffer is far larger than the caches (1 GiB by default), its pages are touched before
    timing, and ``sum`` reads each byte once and writes one number, so the rate is that of
    streaming reads from DRAM with ``threads`` cores (default all): what a batch-1 decode step
    needs to read its weights. One warm-up pass, then ``rounds`` timed passes.
    """
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    with _threads(threads) as n:
        buf.sum()
        rates = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            buf.sum()
            rates.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return {**_stats(rates), "threads": n, "nbytes": buf.numel() * 4}


def transformers_decode_ms(checkpoint_dir: str | os.PathLike, prompt_len: int = 8, steps: int = 16, rounds: int = 3,
                           dtype: torch.dtype = torch.bfloat16, threads: int | None = None) -> dict[str, Any]:
    """transformers eager decode, ms per token with its KV cache, batch 1, greedy.

    The model is loaded once; each round runs a prefill of ``prompt_len`` seeded random tokens
    (not timed), then ``steps`` single-token forward calls, each given the last one's ``cache``
    (transformers 5's name for ``past_key_values``), timed.
    """
    import transformers

    with _threads(threads) as n, torch.no_grad():
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype).eval()
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
        per_round = []
        for _ in range(rounds + 1):  # the first round warms up
            out = model(input_ids=prompt, use_cache=True)
            t0 = time.perf_counter()
            for _ in range(steps):
                nxt = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=nxt, cache=out.cache, use_cache=True)
            per_round.append((time.perf_counter() - t0) / steps * 1e3)
    del model
    per_round = per_round[1:]
    return {**_stats(per_round), "per_round": per_round, "threads": n, "steps": steps, "prompt_len": prompt_len}


def weight_bytes_per_token(config_dict: dict[str, Any], dtype_bytes: int, tied: bool) -> int:
    """Bytes of weights one decode step reads: every linear weight and norm, one embedding row,
    and the LM head (the embedding matrix itself when ``tied``)."""
    shapes = llama_shapes(LlamaConfig.from_hf({**config_dict, "tie_word_embeddings": tied}))
    vocab, hidden = shapes.pop("model.embed_tokens.weight")
    elements = sum(torch.Size(s).numel() for s in shapes.values()) + hidden + (vocab * hidden if tied else 0)
    return elements * dtype_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a Hugging Face Llama checkpoint directory")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    config = json.loads((args.checkpoint / "config.json").read_text())
    wbytes = weight_bytes_per_token(config, torch.empty((), dtype=dtype).element_size(), bool(config.get("tie_word_embeddings")))
    bw = read_bandwidth_gbs(threads=args.threads)
    dec = transformers_decode_ms(args.checkpoint, steps=args.steps, rounds=args.rounds, dtype=dtype, threads=args.threads)
    floor_ms = wbytes / (bw["median"] * 1e9) * 1e3
    print(f"== limits: {args.checkpoint} ({args.dtype}, {dec['threads']} threads)")
    print(f"{'row':<40} {'median':>10} {'min':>10} {'max':>10}")
    print(f"{'read bandwidth, GB/s':<40} {bw['median']:>10.2f} {bw['min']:>10.2f} {bw['max']:>10.2f}")
    print(f"{'weight bytes per decode token, MB':<40} {wbytes / 1e6:>10.1f}")
    print(f"{'bandwidth floor, ms/token':<40} {floor_ms:>10.2f}")
    print(f"{'transformers eager decode, ms/token':<40} {dec['median']:>10.2f} {dec['min']:>10.2f} {dec['max']:>10.2f}")
    print(f"{'  its effective bandwidth, GB/s':<40} {wbytes / dec['median'] / 1e6:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"read_bandwidth_gbs": bw, "weight_bytes_per_token": wbytes, "floor_ms": floor_ms,
                                         "transformers_decode_ms": dec}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
