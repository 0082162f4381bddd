"""The decode-attention dispatches alone (not a test): how long the CPU dispatch takes per
cache entry it reads, at the shapes of a real model's batched decode.

    python tools/bench_attention.py [--batch 8] [--heads 9] [--kv-heads 3] [--head-dim 64]
        [--positions 500,1000,1900] [--layers 30] [--cache float32] [--rounds 5] [--paged] [--page 16]

One compiled program calls the dispatch once per layer, each layer with its own cache (so the
caches of all layers together do not stay in the CPU's caches, as in a decode step), every
sequence at the same position (a causal mask: entries 0..position live). For each position it
prints the median over rounds (and the range) of the program's time, that time per layer, in
nanoseconds per live entry and KV head, and the bytes of K and V read per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--positions", default="500,1000,1900")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--cache", choices=list(DTYPES), default="float32", help="the cache's dtype (a GGUF model exported in float32: float32)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10, help="calls per round")
    p.add_argument("--page", type=int, default=16, help="positions per page (the paged dispatch)")
    p.add_argument("--dump", metavar="DIR", help="also write the compiled dispatches (their assembly among them) into DIR")
    p.add_argument("--contiguous", action="store_true", help="time the contiguous-cache dispatch instead of the paged one")
    a = p.parse_args(argv)

    from iree.turbine import aot

    from sharktank.export import compile_mlir
    from sharktank.export.kernels.custom_op import sharktank_decode_attention, sharktank_paged_decode_attention
    from sharktank.runtime import Session

    b, h, kvh, e, t, n, layers = a.batch, a.heads, a.kv_heads, a.head_dim, a.max_seq_len, a.page, a.layers
    kv = DTYPES[a.cache]
    m = t // n
    scale = e**-0.5
    paged = not a.contiguous

    class Program(torch.nn.Module):
        def forward(self, q, pages, mask, *caches):
            out = []
            for i in range(layers):
                k, v = caches[2 * i], caches[2 * i + 1]
                if paged:
                    out.append(sharktank_paged_decode_attention(q, k, v, pages, mask, scale))
                else:
                    out.append(sharktank_decode_attention(q, k, v, mask, scale))
            return tuple(out)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, e, generator=g)
    pages = torch.randperm(b * m, generator=g).reshape(b, m)  # each row its own pages, scrambled
    shape = (b * m, n, kvh, e) if paged else (b, t, kvh, e)
    caches = [torch.randn(shape, generator=g).to(kv) for _ in range(2 * layers)]
    mask = torch.zeros(b, t, dtype=torch.int8)
    mlir = str(aot.export(Program(), args=(q, pages, mask, *caches)).mlir_module)
    t0 = time.perf_counter()
    session = Session(compile_mlir(mlir, 1, extra=(f"--iree-hal-dump-executable-files-to={a.dump}",) if a.dump else ()), 1)
    print(f"compiled in {time.perf_counter() - t0:.1f} s: {'paged (pages of %d)' % n if paged else 'contiguous'}, batch {b}, {h} heads over {kvh} KV heads of {e}, "
          f"{a.cache} cache of {t}, {layers} layers", flush=True)
    def place(x: torch.Tensor):
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, typed on the device
            from iree import runtime as rt

            return session.place(x.view(torch.int16).numpy().view(np.uint16), 0, rt.HalElementType.BFLOAT_16)
        return session.place(x.numpy(), 0)

    fixed = [place(q), place(pages)]
    cache_arrays = [place(c) for c in caches]  # on the device once: a call moves only the mask
    positions = [int(x) for x in a.positions.split(",")]
    for pos in positions:
        mask[:] = 0
        mask[:, : pos + 1] = 1
        args = fixed + [place(mask)] + cache_arrays
        session.invoke("main", args)  # warm
        times = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                session.invoke("main", args)
            times.append((time.perf_counter() - t0) / a.calls)
        med = statistics.median(times)
        per_layer = med / layers
        entries = b * kvh * (pos + 1)
        read = entries * 2 * e * torch.finfo(kv).bits // 8
        print(f"position {pos:5d}: {med * 1e3:8.2f} ms ({min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}), {per_layer * 1e3:6.3f} ms/layer, "
              f"{per_layer / entries * 1e9:6.1f} ns per entry and KV head, {read / per_layer / 1e9:5.1f} GB/s of K and V", flush=True)


if __name__ == "__main__":
    main()
