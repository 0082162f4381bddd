"""Which IREE data-tiling path compiles the CPU attention correctly, and how fast each is.

CPU export traces attention unfused (``ops.attention_as_matmuls``)
and compiles with ``--iree-global-opt-data-tiling``: with IREE 3.10 the newer
dispatch-creation path (what ``--iree-opt-data-tiling`` picks) gives wrong logits for that
attention. This script shows it, so the choice can be re-checked after an IREE upgrade:

    python tools/check_data_tiling.py [--model toy-llama-3l] [--rounds 200]

For each path it compiles the same exported MLIR, runs prefill (8 tokens) and one decode
step, and prints the largest logit error against eager torch and the median call times (or
the compiler's first error for a path that does not compile: with IREE 3.10 the
dispatch-creation path now fails on these multi-device modules' parameter globals).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

# The flag that stands in for the CPU target's --iree-global-opt-data-tiling.
PATHS = {
    "global-opt (used)": "--iree-global-opt-data-tiling",
    "dispatch-creation": "--iree-opt-data-tiling",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="toy-llama-3l", help="a preset or checkpoint (default toy-llama-3l)")
    parser.add_argument("--rounds", type=int, default=200, help="timed calls per function (default 200)")
    args = parser.parse_args()

    import iree.compiler as ic

    from sharktank.export import compile_flags
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model
    from sharktank.runtime import CompiledModel

    model = load_model(args.model)
    tokens = torch.arange(1, 9)[None]
    with torch.no_grad():
        cache = model.new_cache(1)
        want_prefill = model.prefill(tokens, cache)
        nxt = want_prefill[:, -1].argmax(-1)
        want_decode = model.decode(nxt, cache, torch.tensor([8]))
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(tmp) / "art"
        manifest = export_artifact(model, art, source=args.model)  # compiled as shipped
        mlir = (art / "model.mlir").read_text()
        print(f"{args.model}: max |compiled - eager| of the logits, median ms per call (local-task)")
        for name, flag in PATHS.items():
            flags = [flag if f == PATHS["global-opt (used)"] else f for f in compile_flags(manifest.device_count)]
            try:
                vmfb = ic.compile_str(mlir, extra_args=flags)
            except ic.CompilerToolError as e:  # a path that does not compile is a finding too
                first = next((line for line in str(e).splitlines() if "error:" in line), str(e).splitlines()[0])
                print(f"  {name:<20} does not compile: {first.strip()[:160]}")
                continue
            # A new file renamed into place: the previous module is still mapped.
            (art / "next.vmfb").write_bytes(vmfb)
            os.replace(art / "next.vmfb", art / "model.vmfb")
            m = CompiledModel(art, verify=False)  # the module is not the one the manifest hashed
            logits, c = m.prefill(tokens)
            step, _ = m.decode(nxt, c, torch.tensor([8]))
            err = max(float((logits.float() - want_prefill.float()).abs().max()), float((step.float() - want_decode.float()).abs().max()))
            times = {"prefill": [], "decode": []}
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                _, c2 = m.prefill(tokens, c)
                times["prefill"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                m.decode(nxt, c2, torch.tensor([8]))
                times["decode"].append(time.perf_counter() - t0)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"  {name:<20} error {err:9.3g}   prefill {ms['prefill']:.3f} ms   decode {ms['decode']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
