"""Decode-shaped block products through the CPU kernels (``export.kernels.block_product``),
one layout at a time: ``--weights`` random weights of ``--shape NxK`` (float16 scales within
+-1e-3) in one compiled function with ``--rows`` rows of float32 x (default 1; their products
summed), so that each call reads every weight once, as a decode step does. Printed per layout: us per product
(median over rounds, and the range), the block bytes read per second, and the result's
largest error against float64 ``x @ dequantize(w).T`` relative to its largest value.
``--torch-form``: each layout's same function through the torch form too (``ops.matmul``
without kernels: what a CPU without the kernels' instructions compiles), timed in the same rounds.
``BF16`` and ``F16`` in ``--layouts`` are plain weights of that type (random values within
+-0.05) and x rounded to that type, as such a model's: the yardstick a quantized layout is
judged on, the product a cpu export traces for them (``export.kernels.BlockProducts``: the
hand-written kernel where there is one, e.g. bfloat16 on a CPU without AVX512-BF16, otherwise
IREE's own dense product).

    python tools/bench_kernels.py [--shape 2048x2048] [--layouts Q4_0,Q4_1,Q4_K] [--rows 1] [--rounds 5]
        [--against CHECKOUT]

``--against CHECKOUT``: the same measurement of another checkout's kernels (its ``sharktank``
package first on ``PYTHONPATH``), the two run alternately in subprocesses, ``--pairs`` times, so
that a slow spell of the machine hits both; each printed line names its side. Not a test:
nothing here asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


# Where a block's float16 scales are (d, and dmin or m), where not its first 4 bytes.
SCALES_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}


PLAIN = {"BF16": torch.bfloat16, "F16": torch.float16}


def _plain_cases(name: str, n: int, k: int, weights: int, rows: int) -> dict:
    """The plain ``name`` weights' case (``measure``'s form "plain"): as a cpu export traces them."""
    from sharktank.export import compile_mlir, export_function
    from sharktank.export.compile import QUANTIZED_FLAGS
    from sharktank.export.kernels import BlockProducts
    from sharktank.runtime import Session

    g = torch.Generator().manual_seed(0)
    ws = [((torch.rand(n, k, generator=g) - 0.5) / 10).to(PLAIN[name]) for _ in range(weights)]
    x = torch.randn(rows, k, generator=g)
    products = BlockProducts()

    def fn(x, *ws):
        ys = []
        for w in ws:
            y = products(x.to(w.dtype), w)
            ys.append((x.to(w.dtype) @ w.T if y is None else y).float())
        return sum(ys[1:], ys[0])

    want = sum(x.double() @ w.double().T for w in ws).numpy()
    mlir = str(export_function(fn, (x, *ws)).mlir_module)
    session = Session(compile_mlir(mlir, 1, extra=QUANTIZED_FLAGS), 1)
    from iree import runtime as rt

    element = rt.HalElementType.BFLOAT_16 if name == "BF16" else rt.HalElementType.FLOAT_16
    args = [session.place(x.numpy(), 0)] + [session.place(w.view(torch.uint16).numpy(), 0, element) for w in ws]
    got = np.asarray(session.invoke("main", args)[0].to_host())
    return {(name, "plain"): (session, args, float(np.abs(got - want).max() / np.abs(want).max()), n * k * 2)}


def measure(n: int, k: int, layouts: list[str], weights: int, rounds: int, calls: int, rows: int = 1, torch_form: bool = False) -> list[str]:
    from sharktank import ops
    from sharktank.export import compile_mlir, export_function
    from sharktank.export.compile import QUANTIZED_FLAGS
    from sharktank.export.kernels import block_product
    from sharktank.runtime import Session
    from sharktank.types import LAYOUTS, QuantizedTensor

    cases = {}
    for name in layouts:
        if name in PLAIN:
            cases.update(_plain_cases(name, n, k, weights, rows))
            continue
        lay = LAYOUTS[name]
        rng = np.random.default_rng(0)
        blocks = []
        for _ in range(weights):
            raw = rng.integers(0, 256, size=(n, k // lay.block_size, lay.block_bytes), dtype=np.uint8)
            for at in SCALES_AT.get(name, (0, 2)):  # the block's float16 scales: none NaN
                raw[..., at : at + 2] = (rng.uniform(-1, 1, (n, k // lay.block_size, 1)) * 1e-3).astype(np.float16).view(np.uint8)
            blocks.append(torch.from_numpy(raw))

        def fn(x, *bs, lay=lay):
            ys = [block_product(x, QuantizedTensor(lay, (n, k), b)) for b in bs]
            if any(y is None for y in ys):
                raise SystemExit(f"{lay.name} {n}x{k}: no kernel takes this product here")
            return sum(ys[1:], ys[0])

        def torch_fn(x, *bs, lay=lay):
            ys = [ops.matmul(x, QuantizedTensor(lay, (n, k), b), transpose_rhs=True) for b in bs]
            return sum(ys[1:], ys[0])

        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
        want = sum(x.double() @ QuantizedTensor(lay, (n, k), b).dequantize().double().T for b in blocks).numpy()
        for form, f in [("kernel", fn), ("torch form", torch_fn)][: 2 if torch_form else 1]:
            mlir = str(export_function(f, (x, *blocks), strict=form == "kernel").mlir_module)  # ops.matmul reads a ContextVar: non-strict
            session = Session(compile_mlir(mlir, 1, extra=QUANTIZED_FLAGS), 1)
            args = [session.place(x.numpy(), 0)] + [session.place(b.numpy(), 0) for b in blocks]
            got = np.asarray(session.invoke("main", args)[0].to_host())
            cases[name, form] = (session, args, float(np.abs(got - want).max() / np.abs(want).max()), n * k // lay.block_size * lay.block_bytes)
    times = {case: [] for case in cases}
    for _ in range(rounds + 1):  # the first round warms up
        for case, (session, args, _, _) in cases.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                session.invoke("main", args)[0].to_host()
            times[case].append((time.perf_counter() - t0) / calls / weights * 1e6)
    lines = []
    for (name, form), (_, _, err, nbytes) in cases.items():
        t = times[name, form][1:]
        med = statistics.median(t)
        label = name if form in ("kernel", "plain") else f"{name} ({form})"
        lines.append(f"{label} {rows}x{n}x{k}: {med:.0f} us/product ({min(t):.0f}-{max(t):.0f}), {nbytes / med / 1e3:.1f} GB/s, rel err {err:.2g}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2048x2048", help="NxK of each weight (default 2048x2048)")
    parser.add_argument("--layouts", default="Q4_0,Q4_1,Q5_0,Q5_1,Q4_K", help="comma-separated block layouts (default Q4_0,Q4_1,Q5_0,Q5_1,Q4_K)")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (default 1: a decode step; up to 8: a serving batch's)")
    parser.add_argument("--weights", type=int, default=8, help="weights per function, read in turn (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up (default 5)")
    parser.add_argument("--calls", type=int, default=20, help="calls per layout and round (default 20)")
    parser.add_argument("--torch-form", action="store_true", help="also time each layout's torch form (no kernel) in the same rounds")
    parser.add_argument("--against", type=Path, help="another checkout to measure alternately with this one")
    parser.add_argument("--pairs", type=int, default=2, help="with --against: alternations (default 2)")
    args = parser.parse_args(argv)
    try:
        n, k = (int(v) for v in args.shape.split("x"))
    except ValueError:
        parser.error(f"--shape: expected NxK, found {args.shape!r}")
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if args.against is None:
        for line in measure(n, k, layouts, args.weights, args.rounds, args.calls, args.rows, args.torch_form):
            print(line, flush=True)
        return 0
    if not (args.against / "sharktank" / "__init__.py").is_file():
        parser.error(f"--against: expected a checkout holding sharktank/__init__.py, found {args.against}")
    here = Path(__file__).resolve().parent.parent
    child = [sys.executable, str(Path(__file__).resolve()), "--shape", args.shape, "--layouts", ",".join(layouts),
             "--weights", str(args.weights), "--rounds", str(args.rounds), "--calls", str(args.calls), "--rows", str(args.rows)] + (["--torch-form"] if args.torch_form else [])
    for pair in range(args.pairs):
        for side, root in (("this", here), ("against", args.against.resolve())):
            env = {**os.environ, "PYTHONPATH": str(root)}
            out = subprocess.run(child, env=env, cwd="/", capture_output=True, text=True, timeout=1800)
            if out.returncode:
                sys.stderr.write(out.stderr[-2000:])
                return out.returncode
            for line in out.stdout.splitlines():
                print(f"[{side} {pair + 1}] {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
