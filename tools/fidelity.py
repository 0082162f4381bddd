"""Fidelity of a GGUF model through sharktank against transformers' float32 load of the same file.

For each layout (eager, and compiled artifacts such as tp1 or tp3xpp2) it prints the
perplexity of a text (llama-perplexity's method, `sharktank perplexity`), next to
transformers' perplexity of the same weights and ids, and how close the logits are at every
position of every chunk: the largest absolute error, one minus the cosine similarity (mean and
largest),
and the share of positions whose top-1 token is the same.

    python tools/fidelity.py ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text tests/data/us_founding_texts.txt --window 128 --layouts eager,tp1,tp3xpp2

Artifacts are exported once into --cache (outside the repo) and reused; transformers needs
`accelerate` to load a GGUF. Not a test: a table for notes and docs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch


def parse_layout(name: str) -> tuple[int, int | None] | None:
    """``eager`` -> None; ``tp3`` -> (3, None); ``tp3xpp2`` -> (3, 2)."""
    if name == "eager":
        return None
    m = re.fullmatch(r"tp(\d+)(?:xpp(\d+))?", name)
    if not m:
        raise SystemExit(f"--layouts: expected eager, tpN or tpNxppM, found {name!r}")
    return int(m[1]), int(m[2]) if m[2] else None


def artifact(model: Path, tp: int, pp: int | None, max_seq_len: int, cache: Path) -> Path:
    """The model exported and compiled at tp x pp (reused when already in the cache)."""
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    out = cache / f"{model.stem}-tp{tp}-pp{pp or 1}-len{max_seq_len}"
    if not (out / "manifest.json").is_file():
        print(f"exporting {out.name} ...", file=sys.stderr, flush=True)
        export_artifact(load_model(model, tp=tp, pp=pp, deferred=True), out, source=str(model), max_seq_len=max_seq_len,
                        progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    return out


def compare(chunks_ours: list[torch.Tensor], chunks_ref: list[torch.Tensor]) -> dict:
    """Logit agreement over every position of every chunk."""
    a, b = torch.cat(chunks_ours).double(), torch.cat(chunks_ref).double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {
        "max_abs_err": (a - b).abs().max().item(),
        "cos_mean": cos.mean().item(),
        "cos_min": cos.min().item(),
        "top1_agree": (a.argmax(-1) == b.argmax(-1)).double().mean().item(),
        "positions": a.shape[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a GGUF file")
    p.add_argument("--text", type=Path, required=True, help="a UTF-8 text file")
    p.add_argument("--window", type=int, default=128, help="perplexity window (even; default 128)")
    p.add_argument("--layouts", default="eager,tp1", help="comma-separated: eager, tpN, tpNxppM (default eager,tp1)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "sharktank" / "fidelity", help="where artifacts are kept")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from sharktank.evaluate import bos_to_add, open_target, perplexity

    layouts = [(name, parse_layout(name)) for name in args.layouts.split(",")]
    eager = open_target(args.model)
    ids = eager.tokenizer.encode(args.text.read_text(encoding="utf-8"), add_special_tokens=True)
    bos = bos_to_add(eager.tokenizer)

    ref_model = AutoModelForCausalLM.from_pretrained(args.model.parent, gguf_file=args.model.name, dtype=torch.float32).eval()

    def recording(logits_of):
        seen: list[torch.Tensor] = []

        def wrapped(chunk: torch.Tensor) -> torch.Tensor:
            out = torch.as_tensor(logits_of(chunk)).float()
            seen.append(out)
            return out

        return wrapped, seen

    def ref_logits(chunk: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return ref_model(chunk[None]).logits[0]

    ref_of, ref_seen = recording(ref_logits)
    ref = perplexity(ref_of, ids, args.window, bos_id=bos)
    rows = {"transformers float32": {"ppl": ref.ppl, "tokens_per_s": ref.tokens_per_s}}
    for name, layout in layouts:
        target = eager if layout is None else open_target(artifact(args.model, *layout, max_seq_len=args.window, cache=args.cache))
        of, seen = recording(target.load())
        r = perplexity(of, ids, args.window, bos_id=bos)
        rows[name] = {"ppl": r.ppl, "ppl_rel_diff": r.ppl / ref.ppl - 1, "tokens_per_s": r.tokens_per_s, **compare(seen, ref_seen)}

    info = {"model": str(args.model), "text": str(args.text), "tokens": len(ids), "window": args.window,
            "tokens_scored": ref.tokens_scored, "rows": rows}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{args.model.name} on {args.text.name}: {len(ids)} tokens, window {args.window}, {ref.tokens_scored} tokens scored")
    print("| run | perplexity | vs transformers | max abs logit err | 1 - cosine, mean / max | top-1 agree |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "cos_mean" not in r:
            print(f"| {name} | {r['ppl']:.6f} | - | - | - | - |")
        else:
            print(f"| {name} | {r['ppl']:.6f} | {r['ppl_rel_diff']:+.2e} | {r['max_abs_err']:.2e} | "
                  f"{1 - r['cos_mean']:.1e} / {1 - r['cos_min']:.1e} | {100 * r['top1_agree']:.2f}% of {r['positions']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
