"""What one exchange between two CPU devices costs in the compiled runtime, apart from any work.

    python tools/bench_exchange.py [--exchanges 16] [--rounds 7] [--inner 100]

Two programs of ``--exchanges`` steps each, compiled for cpu with the flags artifacts get,
run on ``local-task`` and timed side by side (interleaved rounds):

- *two devices*: each step, each device applies a small elementwise op to its own 2048-float
  vector, then the two swap vectors and add (as a two-device all-reduce does), so each device
  waits on the other's result once per step;
- *one device*: the same ops and values on one device, no transfers.

``(two - one) / exchanges`` is the price of one such exchange. A tensor-parallel decode pays it
twice per layer (after the attention output and after the FFN down product): the 1B Llama's 16
layers at tp2 pay it 32 times per token, the same whatever the weights' precision.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import torch

from bench_timing import interleaved


class _Exchange(torch.nn.Module):
    def __init__(self, steps: int, devices: int):
        super().__init__()
        self.steps, self.devices = steps, devices

    def forward(self, a, b):
        from iree.turbine.ops.iree import transfer_to_logical_device as to

        for _ in range(self.steps):
            a, b = torch.tanh(a * 1.01), torch.tanh(b * 1.01)
            a, b = (a + to("0", b), to("1", a) + b) if self.devices == 2 else (a + b, a + b)
        return a, b


def _session(steps: int, devices: int):
    from iree.turbine import aot

    from sharktank.export.compile import compile_mlir
    from sharktank.runtime.session import Session

    x = torch.randn(2048)
    y = torch.randn(2048)
    e = aot.export(_Exchange(steps, devices), args=(x, y), arg_device={0: aot.DeviceAffinity(0), 1: aot.DeviceAffinity(devices - 1)})
    session = Session(compile_mlir(str(e.mlir_module), devices), devices)  # the flags artifacts get
    args = [session.place(x.numpy(), 0), session.place(y.numpy(), devices - 1)]
    want = _Exchange(steps, devices)(x, y)
    got = [np.asarray(r.to_host()) for r in session.invoke("main", args)]
    if not all(np.allclose(g, w.numpy(), rtol=1e-4, atol=1e-5) for g, w in zip(got, want)):
        raise SystemExit(f"{devices}-device program: compiled results differ from eager")
    return lambda: session.invoke("main", args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # A 32-step program did not finish (over an hour) once with iree-base-runtime 3.10 here;
    # not investigated, so the steps are bounded.
    parser.add_argument("--exchanges", type=int, default=16, choices=range(1, 17), metavar="1..16", help="steps per call (default 16)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--inner", type=int, default=100, help="calls per round and program (default 100)")
    args = parser.parse_args(argv)
    fns = {"two devices": _session(args.exchanges, 2), "one device": _session(args.exchanges, 1)}
    t = interleaved(fns, args.rounds, args.inner)
    per = sorted((a - b) / args.exchanges * 1e6 for a, b in zip(t["two devices"], t["one device"]))
    for name, v in t.items():
        print(f"{name}: {statistics.median(v) * 1e6:.0f} us per call of {args.exchanges} steps (min {min(v) * 1e6:.0f}, max {max(v) * 1e6:.0f})")
    print(f"one exchange: {statistics.median(per):.1f} us (per-round range {per[0]:.1f}-{per[-1]:.1f}), {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
