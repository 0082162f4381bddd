"""The paged decode-attention dispatch (export/kernels/attention.py, ``paged_module_asm``),
compiled, against float64 attention over the gathered pages; and when export takes it
(kernels.paged_decode_attention, offered by ops.paged_attention).

One exported program holds the cases (one compile), its pools of any page count (a dynamic
dim), called with two pool sizes: pages of 4 (a chunk of 16 entries spans four), 8, 12 (no
whole pages in a chunk: a table read per entry) and 16; grouped (8 query heads over 2 KV
heads) and plain heads; bfloat16 and float32 caches. The table is scrambled, one page is
shared by both sequences, and the pool holds more pages than the table names, all of them
NaN: a page read that the table does not name spoils the result. Masks: causal at positions 5
and 40, and one with holes (a whole chunk left out, and entries of a live chunk)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharktank import ops
from sharktank.export import compile_mlir
from sharktank.export.kernels import attention, decode_attention, paged_decode_attention
from sharktank.export.kernels.custom_op import sharktank_paged_decode_attention
from sharktank.runtime import Session
from test_attention_kernel import _reference as contiguous_reference

B, T, E, POOL = 2, 48, 64, 40  # three chunks of 16 entries; 40 pages, at most 24 named
CASES = [  # (page size, query heads, KV heads, cache dtype, q dtype)
    (4, 8, 2, torch.bfloat16, torch.float32),
    (16, 4, 4, torch.float32, torch.float32),
    (8, 8, 2, torch.bfloat16, torch.bfloat16),
    (12, 8, 2, torch.float32, torch.float32),
]
POSITIONS = torch.tensor([5, 40])
SCALE = E**-0.5


def _masks() -> dict[str, torch.Tensor]:
    causal = torch.arange(T)[None] <= POSITIONS[:, None]
    holes = causal.clone()
    holes[1, 16:32] = False  # a whole chunk skipped
    holes[1, 35:41:2] = False  # entries of a live chunk left out
    return {"causal": causal, "holes": holes}


MASKS = _masks()


def _table(n: int, seed: int) -> torch.Tensor:
    """[B, T / n] pages in a scrambled order, the first shared by both sequences (entries
    0..n-1: live in both)."""
    pages = torch.randperm(POOL, generator=torch.Generator().manual_seed(seed))[: B * (T // n)].reshape(B, T // n)
    pages[1, 0] = pages[0, 0]
    return pages


def _operands(n: int, h: int, kvh: int, kv: torch.dtype, qd: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    pages = _table(n, seed)
    q = torch.randn(B, h, E, generator=g).to(qd)
    k = torch.full((POOL, n, kvh, E), float("nan"))  # pages the table does not name
    v = torch.full((POOL, n, kvh, E), float("nan"))
    k[pages] = 2 * torch.randn(B, T // n, n, kvh, E, generator=g)  # scores of a few units: a peaked softmax
    v[pages[1]] = torch.randn(T // n, n, kvh, E, generator=g)
    v[pages[0]] = torch.randn(T // n, n, kvh, E, generator=g)
    v[pages[1, 0]] = torch.randn(n, kvh, E, generator=g)  # the shared page: one content for both rows

    def at(b: int, t: int):
        return pages[b, t // n], t % n

    # What the "holes" mask leaves out would stand out if weighed: larger keys (a skipped
    # chunk), larger values (a live one).
    for t in range(16, 32):
        k[at(1, t)] *= 4
    for t in range(35, 41, 2):
        v[at(1, t)] *= 100
    # And what is not a number past the positions (masked in both masks; not in the shared
    # page): left out, not weighed 0, in chunks the dispatch skips and in ones it reads.
    k[at(0, 44)], v[at(0, 45)], k[at(1, 47)], v[at(1, 46)] = float("inf"), float("nan"), float("nan"), float("inf")
    return q, k.to(kv), v.to(kv), pages


def _reference(q, k_pool, v_pool, pages, mask, scale: float) -> torch.Tensor:
    """Float64 attention over each sequence's pages gathered (the contiguous test's)."""
    b, _, e = q.shape
    return contiguous_reference(q, *(pool[pages].reshape(b, T, pool.shape[2], e) for pool in (k_pool, v_pool)), mask, scale)


class _Program(torch.nn.Module):
    """Every case with every mask through ``op`` (the paged prefill test's program too)."""

    def __init__(self, op=sharktank_paged_decode_attention):
        super().__init__()
        self.op = op

    def forward(self, *args):
        out = []
        for i, (n, h, kvh, kv, qd) in enumerate(CASES):
            q, k, v, pages = args[4 * i : 4 * i + 4]
            for mask in args[4 * len(CASES) :]:
                # float32 inputs (the runtime's numpy side has no bfloat16): cast here.
                out.append(self.op(q.to(qd), k.to(kv), v.to(kv), pages, mask, SCALE).float())
        return tuple(out)


def _inputs(operands, pool: int) -> list[np.ndarray]:
    """The program's inputs with pools of ``pool`` pages (those past POOL: NaN)."""
    def grown(t):
        return torch.cat([t.float(), torch.full((pool - POOL, *t.shape[1:]), float("nan"))])

    args = [x for q, k, v, pages in operands for x in (q.float(), grown(k), grown(v), pages)]
    return [a.numpy() for a in args + [m.to(torch.int8) for m in MASKS.values()]]


@pytest.fixture(scope="module")
def compiled():
    from iree.turbine import aot

    operands = [_operands(*case, seed=i) for i, case in enumerate(CASES)]
    args = [torch.from_numpy(a) for a in _inputs(operands, POOL)]
    pages = torch.export.Dim("pool_pages", min=2)
    dynamic = [{0: pages} if i < 4 * len(CASES) and i % 4 in (1, 2) else None for i in range(len(args))]
    mlir = str(aot.export(_Program(), args=tuple(args), dynamic_shapes={"args": tuple(dynamic)}).mlir_module)
    session = Session(compile_mlir(mlir, 1), 1)
    keys = [(i, name) for i in range(len(CASES)) for name in MASKS]
    results = {}
    for pool in (POOL, 64):  # the page count is the caller's
        got = session.call("main", _inputs(operands, pool), [0] * len(args))
        results[pool] = dict(zip(keys, (torch.from_numpy(np.asarray(r)) for r in got), strict=True))
    return mlir, operands, results


def _elem(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"page{n}-h{h}-kv{kvh}-{str(kv)[6:]}-q{str(qd)[6:]}" for n, h, kvh, kv, qd in CASES])
def test_paged_dispatch_matches_attention_in_float64(compiled, case, mask):
    mlir, operands, results = compiled
    q, k, v, pages = operands[case]
    n, h, kvh, kv, qd = CASES[case]
    name = attention.paged_function_name(B, h, T // n, n, kvh, E, _elem(qd), _elem(kv), SCALE)
    assert f"util.call @{name}(" in mlir and f"tensor<?x{n}x{kvh}x{E}x{_elem(kv)}>" in mlir
    want = _reference(q, k, v, pages, MASKS[mask], SCALE)
    # float32 scores, softmax and sums (the cache's values as stored): summation order and the
    # exponential's rounding; a bfloat16 result adds its own rounding, 2^-8 of each value.
    bound = 1e-5 * want.abs().max() + (2.0**-8 * want.abs() if qd == torch.bfloat16 else 0)
    for pool, got in results.items():
        err = (got[(case, mask)].double() - want).abs()
        assert bool((err <= bound).all()), f"{pool} pages: max |error| {err.max().item():.3g}"
    # The custom op's eager form (pages gathered) is the same computation in torch.
    eager = sharktank_paged_decode_attention(q, k, v, pages, MASKS[mask].to(torch.int8), SCALE).double()
    assert bool(((eager - want).abs() <= bound).all())


class _Attend(torch.nn.Module):
    def forward(self, q, k_pool, v_pool, pages, mask):
        return ops.paged_attention(q, k_pool, v_pool, pages, mask, enable_gqa=True)


def _traced(length: int, kernels: tuple) -> str:
    """The graph of ``ops.paged_attention`` traced for ``length`` queries a row (a dynamic
    length for more than one) over a pool of a dynamic page count, under ``kernels``."""
    q, k, v, pages = _operands(4, 8, 2, torch.bfloat16, torch.float32, seed=3)
    k, v = (torch.where(t.isfinite(), t, 0) for t in (k, v))
    q4 = q[:, :, None].expand(B, 8, length, E).contiguous()  # [B, H, L, E]
    mask = MASKS["causal"][:, None, None, :].expand(B, 1, length, T)
    count, queries = torch.export.Dim("P", min=2), ({2: torch.export.Dim("L", min=2)} if length > 1 else None)
    dynamic = {"q": queries, "k_pool": {0: count}, "v_pool": {0: count}, "pages": None, "mask": queries}
    with ops.attention_kernels(*kernels):
        return str(torch.export.export(_Attend(), (q4, k, v, pages, mask), dynamic_shapes=dynamic, strict=False).graph)


def test_export_takes_the_paged_dispatch_for_one_query():
    graph = _traced(1, (decode_attention, paged_decode_attention))
    assert graph.count("turbine.sharktank_paged_decode_attention.default") == 1
    assert "index_select" not in graph and "softmax" not in graph  # no gather, no torch attention
    # A prompt (more than one query a row) keeps the torch form: the pages gathered.
    graph = _traced(2, (decode_attention, paged_decode_attention))
    assert "sharktank_paged_decode_attention" not in graph and "index_select" in graph
    # Without the paged kernel, the gathered pages are offered to the contiguous one.
    graph = _traced(1, (decode_attention,))
    assert "sharktank_paged_decode_attention" not in graph and graph.count("turbine.sharktank_decode_attention.default") == 1


def test_eager_paged_attention_is_the_gather_and_never_offered():
    q, k, v, pages = _operands(4, 8, 2, torch.bfloat16, torch.float32, seed=4)
    k, v = (torch.where(t.isfinite(), t, 0) for t in (k, v))
    q4, mask = q[:, :, None], MASKS["holes"][:, None, None, :]
    with ops.attention_kernels(lambda *a: pytest.fail("offered an eager call"), lambda *a: pytest.fail("offered an eager call")):
        got = ops.paged_attention(q4, k, v, pages, mask, enable_gqa=True)
    torch.testing.assert_close(got[:, :, 0].double(), _reference(q, k.float(), v.float(), pages, MASKS["holes"], SCALE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "what, change",
    [
        ("two queries", lambda q, k, v, p, m: (q.expand(B, 8, 2, E), k, v, p, m)),
        ("entries not a multiple of 16", lambda q, k, v, p, m: (q, k, v, p[:, :10], m[..., :40])),
        ("a mask per head", lambda q, k, v, p, m: (q, k, v, p, m.expand(B, 8, 1, T))),
        ("an additive mask", lambda q, k, v, p, m: (q, k, v, p, torch.zeros(B, 1, 1, T))),
        ("an int32 table", lambda q, k, v, p, m: (q, k, v, p.int(), m)),
        ("a float64 query", lambda q, k, v, p, m: (q.double(), k, v, p, m)),
    ],
)
def test_other_forms_keep_the_torch_form(what, change):
    q, k, v, pages = _operands(4, 8, 2, torch.bfloat16, torch.float32, seed=5)
    args = change(q[:, :, None], k, v, pages, MASKS["causal"][:, None, None, :])
    assert paged_decode_attention(*args, SCALE) is None, what
