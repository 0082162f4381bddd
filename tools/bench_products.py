"""Prompt-shaped products compiled alone: GFLOP/s of ``x [M, K] @ w.T`` as our CPU export
compiles a prefill's products (``compile_mlir``'s flags), the weight an argument of the
function as a model's parameters are (not constants IREE could fold or pack at compile time).

    python tools/bench_products.py [--shape 128x1536x576] [--layout Q4_1] [--rounds 3] [--reps 10]
        [--flags="--iree-llvmcpu-enable-ukernels=all"]

Cases, each its own compiled function, timed in interleaved rounds
(``bench_timing.interleaved``: one warm-up call each, then the mean of ``--reps`` calls per
round; printed: the median over rounds and its range):

- ``quant f32`` / ``quant bf16`` / ``quant f16``: a ``--layout`` weight (random blocks, small float16 scales)
  through ``ops.linear`` as a prompt takes it (more rows than a block product's: the weight
  dequantized to x's dtype, then the dense product);
- ``dense f32`` / ``dense bf16`` / ``dense f16``: the same product of a plain float weight, the
  floor the quantized form is judged on (``dense f16``: a float16 model's, e.g. an F16 GGUF's);
- ``kernels f32`` / ``kernels bf16`` / ``kernels f16``: the product as a cpu export traces it
  (``export.kernels.BlockProducts``: the decode kernel for M <= 8, the prefill dispatch for
  more), ``kernels dense f16``: the plain float16 weight as a cpu export traces it (the
  prefill dispatch for M > 8, ``export.kernels.f16``), and ``prefill bf16``: the prefill
  dispatch at any M (where it refuses the shape, or the CPU lacks AVX512-BF16, these cases
  are left out);
- with ``--flags``, each dense case again compiled with those extra compiler flags.

It says where a quantized prompt's time goes and what the kernels make of it, e.g. whether
the prefill dispatch beats the decode kernels at 8 rows (a serving batch). Not a test:
nothing here asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_timing import interleaved  # noqa: E402

from sharktank import ops  # noqa: E402
from sharktank.export import arg_devices, compile_mlir, export_function  # noqa: E402
from sharktank.export.kernels import BlockProducts, prefill_product  # noqa: E402
from sharktank.runtime import Session  # noqa: E402
from sharktank.types import LAYOUTS, QuantizedTensor  # noqa: E402


def _blocks(layout: str, n: int, k: int) -> torch.Tensor:
    lay = LAYOUTS[layout]
    nb = k // lay.block_size
    blocks = torch.randint(0, 256, (n, nb, lay.block_bytes), dtype=torch.uint8)
    # Every layout here starts its block with float16 scale(s): small ones keep values finite.
    blocks[..., :4] = (torch.rand(n, nb, 2) * 0.01).half().view(torch.uint8).reshape(n, nb, 4)
    return blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="128x1536x576", help="MxNxK: rows of x, weight rows, weight columns (default 128x1536x576)")
    parser.add_argument("--layout", default="Q4_1", choices=sorted(LAYOUTS), help="the quantized weight's block layout (default Q4_1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per case and round (default 10)")
    parser.add_argument("--flags", default="", help="extra compiler flags (space-separated) for a second build of the dense cases")
    args = parser.parse_args(argv)
    try:
        m, n, k = (int(v) for v in args.shape.split("x"))
    except ValueError:
        parser.error(f"--shape: expected MxNxK, e.g. 128x1536x576, found {args.shape!r}")
    if k % LAYOUTS[args.layout].block_size:
        parser.error(f"--shape: K={k} is not a multiple of {args.layout}'s block size {LAYOUTS[args.layout].block_size}")
    torch.manual_seed(0)
    x, blocks = torch.randn(m, k), _blocks(args.layout, n, k)
    dense = QuantizedTensor(args.layout, (n, k), blocks).dequantize()
    extra = tuple(args.flags.split())
    cases = {}
    for dt, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")):
        def quant(x, b, dt=dt):
            return ops.linear(x.to(dt), QuantizedTensor(args.layout, (n, k), b)).float()

        def plain(x, w, dt=dt):
            return ops.linear(x.to(dt), w.to(dt)).float()

        def kernels(x, b, dt=dt):
            with ops.block_kernels(BlockProducts()):
                return ops.linear(x.to(dt), QuantizedTensor(args.layout, (n, k), b)).float()

        cases[f"quant {tag}"] = (quant, (x, blocks), ())
        cases[f"dense {tag}"] = (plain, (x, dense), ())
        cases[f"kernels {tag}"] = (kernels, (x, blocks), ())
        if extra:
            cases[f"dense {tag} +flags"] = (plain, (x, dense), extra)
    def f16_kernels(x, w):
        with ops.block_kernels(BlockProducts()):
            return ops.linear(x.half(), w).float()

    if prefill_product(x[:9].half(), dense.half()) is not None:
        cases["kernels dense f16"] = (f16_kernels, (x, dense.half()), ())
    w = QuantizedTensor(args.layout, (n, k), blocks)
    if prefill_product(x[:9].bfloat16(), w) is not None:
        cases["prefill bf16"] = (lambda x, b: prefill_product(x.bfloat16(), w.with_blocks(b)).float(), (x, blocks), ())
    built = {}
    for name, (fn, fargs, flags) in cases.items():
        print(f"compiling {name} ...", flush=True)
        mlir = str(export_function(fn, fargs, strict=False).mlir_module)
        built[name] = (Session(compile_mlir(mlir, 1, extra=flags), 1), [a.numpy() for a in fargs], arg_devices(fargs))
    calls = {name: (lambda s=session, i=inputs, d=devices: s.call("main", i, d)) for name, (session, inputs, devices) in built.items()}
    results = {name: [t * 1e3 for t in seconds] for name, seconds in interleaved(calls, args.rounds, args.reps).items()}
    gflop = 2 * m * n * k / 1e9
    print(f"\n{m}x{n}x{k}, {args.layout}, {args.rounds} rounds" + (f", flags: {args.flags}" if extra else ""))
    print("| case | ms median (min-max) | GFLOP/s |\n|---|---|---|")
    for name, ms in results.items():
        med = statistics.median(ms)
        print(f"| {name} | {med:.2f} ({min(ms):.2f}-{max(ms):.2f}) | {gflop / med * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
