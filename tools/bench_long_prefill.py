"""A long prompt prefilled whole against in chunks through ``prefill_chunk_bs1`` (not a test).

    python tools/bench_long_prefill.py ARTIFACT_DIR [--prompt 2048] [--chunks 256,512,1024] [--rounds 3] [--driver local-task]

``CompiledModel.prefill`` of a batch-1 prompt longer than ``prefill_chunk_tokens`` (512 by
default) runs as chunks where the artifact has ``prefill_chunk_bs1`` (every one-path export by
default). This times one ``--prompt``-token prompt (seeded random ids) both ways on the same
loaded model, the sides interleaved in ``--rounds`` rounds: whole (one ``prefill_bs1`` call)
and in chunks of each ``--chunks`` size, the last position's logits only (as generation asks),
and prints each side's median and range, its ratio to the whole prompt, and the largest
difference of its last logits from the whole prompt's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="a compiled export directory with prefill_chunk_bs1 (exported with the default --functions)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048; at most the exported cache length)")
    ap.add_argument("--chunks", default="256,512,1024", help="chunk sizes to time against the whole prompt (default 256,512,1024)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--driver", default=None, choices=("local-task", "local-sync"), help="IREE driver (default: the artifact's)")
    args = ap.parse_args(argv)
    import torch

    from sharktank.runtime import CompiledModel

    model = CompiledModel(args.artifact, driver=args.driver)
    if model.find("prefill_chunk", 1) is None:
        ap.error(f"{args.artifact} has no prefill_chunk_bs1 (export it with the default --functions)")
    chunks = [int(c) for c in args.chunks.split(",")]
    ids = torch.randint(0, model.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    sides = {"whole": args.prompt + 1, **{f"chunks of {c}": c for c in chunks}}
    times: dict[str, list[float]] = {s: [] for s in sides}
    last: dict[str, torch.Tensor] = {}
    for side, size in sides.items():  # warm-up: each function once
        model.prefill_chunk_tokens = size
        last[side] = model.prefill(ids, logits="last")[0][0, -1].float()
    for r in range(args.rounds):
        for side, size in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            model.prefill_chunk_tokens = size
            t0 = time.perf_counter()
            out, _ = model.prefill(ids, logits="last")
            out[0, -1].argmax().item()
            times[side].append(time.perf_counter() - t0)
    base = statistics.median(times["whole"])
    print(f"{args.prompt}-token prompt, {args.rounds} interleaved rounds ({args.artifact}):")
    for side, ts in times.items():
        med = statistics.median(ts)
        diff = (last[side] - last["whole"]).abs().max().item()
        print(f"  {side:16s} {med:7.2f} s (range {min(ts):.2f}-{max(ts):.2f}), {med / base:.2f}x the whole prompt; "
              f"last logits within {diff:.2e} of the whole prompt's (largest {last['whole'].abs().max().item():.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
