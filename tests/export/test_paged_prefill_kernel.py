"""The paged prefill-attention dispatch (export/kernels/attention.py,
``paged_prefill_module_asm``), compiled, against float64 attention over each row's gathered
pages; and when export takes it (kernels.paged_attention, offered by ops.paged_attention for a
prompt chunk).

One exported program holds the cases (one compile) with the query rows, the table's width
and the pool's pages dynamic, called twice: chunks of 3 tokens per sequence (6 rows: fewer
than the dispatch's workgroups per KV head) over the whole tables, and of 6 (12 rows) over
the tables less their last page, in a larger pool (44, 32, 40 and 36 entries: most not a
multiple of the 16-entry chunk). The pools, tables and NaN pages are the paged decode test's
(test_paged_attention_kernel.py: a page no table names holds NaN, one page is shared by both
sequences); each row attends causally up to its own position (sequence 0's tokens from
position 2 on, sequence 1's from 33 on: into the third chunk), and a second mask gives rows
holes (a whole chunk left out of some rows, single entries of others)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharktank import ops
from sharktank.export import compile_mlir
from sharktank.export.kernels import attention, paged_attention, paged_decode_attention, paged_prefill_attention
from sharktank.export.kernels.custom_op import sharktank_paged_prefill_attention
from sharktank.runtime import Session
from test_attention_kernel import _reference as contiguous_reference
from test_paged_attention_kernel import B, CASES, E, POOL, SCALE, T, _elem, _operands

STARTS = (2, 33)  # each sequence's first token's position
CALLS = ((3, 0), (6, 1))  # (tokens per sequence, pages left off each table's end) of the two calls


def _masks(length: int, t: int = T) -> dict[str, torch.Tensor]:
    """``[B * length, t]`` booleans, sequence s's rows s * length ...: causal up to each row's
    position, and the same with holes."""
    positions = torch.tensor([[s + i for i in range(length)] for s in STARTS]).reshape(-1)
    causal = torch.arange(t)[None] <= positions[:, None]
    holes = causal.clone()
    holes[length :, 16:32] = False  # sequence 1's rows skip a whole chunk
    holes[1, 0] = False  # and single entries of a live chunk
    holes[length + 2, 34 % t] = False
    return {"causal": causal, "holes": holes}


def _queries(h: int, qd: torch.dtype, length: int, seed: int) -> torch.Tensor:
    return torch.randn(B * length, h, E, generator=torch.Generator().manual_seed(100 + seed)).to(qd)


def _reference(q, k_pool, v_pool, pages, mask) -> torch.Tensor:
    """Float64 attention of each row over its sequence's pages ``pages`` [B, M] gathered."""
    r, t = mask.shape
    table = pages.repeat_interleave(r // B, dim=0)
    return contiguous_reference(q, *(pool[table].reshape(r, t, pool.shape[2], E) for pool in (k_pool, v_pool)), mask, SCALE)


def _table(pages: torch.Tensor, short: int) -> torch.Tensor:
    """``pages`` [B, M] less its last ``short`` pages."""
    return pages[:, : pages.shape[1] - short]


def _case_masks(case: int, length: int, short: int) -> dict[str, torch.Tensor]:
    n = CASES[case][0]
    return _masks(length, T - short * n)


class _Program(torch.nn.Module):
    """Each case's dispatch with each of its two masks (its rows, table width and pool dynamic)."""

    def forward(self, *args):
        out = []
        for i, (n, h, kvh, kv, qd) in enumerate(CASES):
            q, k, v, pages, *masks = args[6 * i : 6 * i + 6]
            for mask in masks:
                # float32 inputs (the runtime's numpy side has no bfloat16): cast here.
                out.append(sharktank_paged_prefill_attention(q.to(qd), k.to(kv), v.to(kv), pages, mask, SCALE).float())
        return tuple(out)


def _inputs(operands, queries, length: int, pool: int, short: int) -> list[np.ndarray]:
    """Per case: q, the pools grown to ``pool`` pages (NaN past POOL), the table less its last
    ``short`` pages and transposed, and the two masks flat."""
    def grown(t):
        return torch.cat([t.float(), torch.full((pool - POOL, *t.shape[1:]), float("nan"))])

    args = []
    for i, ((_, k, v, pages), q) in enumerate(zip(operands, queries)):
        masks = _case_masks(i, length, short)
        args += [q.float(), grown(k), grown(v), _table(pages, short).T.contiguous(), *(m.flatten().to(torch.int8) for m in masks.values())]
    return [a.numpy() for a in args]


@pytest.fixture(scope="module")
def compiled():
    from iree.turbine import aot

    operands = [_operands(*case, seed=i) for i, case in enumerate(CASES)]
    queries = {length: [_queries(h, qd, length, i) for i, (_, h, _, _, qd) in enumerate(CASES)] for length, _ in CALLS}
    (length, short), pool = CALLS[0], POOL
    args = [torch.from_numpy(a) for a in _inputs(operands, queries[length], length, pool, short)]
    pages, rows = torch.export.Dim("pool_pages", min=2), torch.export.Dim("rows", min=2)
    dynamic = []
    for i in range(len(CASES)):  # each case's table width and masks its own
        width, flat = torch.export.Dim(f"width{i}", min=2), torch.export.Dim(f"flat{i}", min=2)
        dynamic += [{0: rows}, {0: pages}, {0: pages}, {0: width}, {0: flat}, {0: flat}]
    mlir = str(aot.export(_Program(), args=tuple(args), dynamic_shapes={"args": tuple(dynamic)}).mlir_module)
    session = Session(compile_mlir(mlir, 1), 1)
    results = {}
    for (length, short), pool in zip(CALLS, (POOL, 64)):  # the row, table and page counts are the caller's
        got = session.call("main", _inputs(operands, queries[length], length, pool, short), [0] * len(args))
        keys = [(i, name) for i in range(len(CASES)) for name in ("causal", "holes")]
        results[length] = dict(zip(keys, (torch.from_numpy(np.asarray(r)) for r in got), strict=True))
    return mlir, operands, queries, results


@pytest.mark.parametrize("mask", ["causal", "holes"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"page{n}-h{h}-kv{kvh}-{str(kv)[6:]}-q{str(qd)[6:]}" for n, h, kvh, kv, qd in CASES])
def test_prefill_dispatch_matches_attention_in_float64(compiled, case, mask):
    mlir, operands, queries, results = compiled
    _, k, v, pages = operands[case]
    n, h, kvh, kv, qd = CASES[case]
    name = attention.paged_prefill_function_name(B, h, n, kvh, E, _elem(qd), _elem(kv), SCALE)
    assert f"util.call @{name}(" in mlir and f"tensor<?x{h}x{E}x{_elem(qd)}>" in mlir
    for length, short in CALLS:
        q, m = queries[length][case], _case_masks(case, length, short)[mask]
        want = _reference(q, k, v, _table(pages, short), m)
        assert want.shape == (B * length, h, E) and bool(want.isfinite().all())
        # As the decode dispatch's bound (the same walk per row).
        bound = 1e-5 * want.abs().max() + (2.0**-8 * want.abs() if qd == torch.bfloat16 else 0)
        err = (results[length][(case, mask)].double() - want).abs()
        assert bool((err <= bound).all()), f"{length} tokens a sequence, {m.shape[1]} entries: max |error| {err.max().item():.3g}"
        # The custom op's eager form (each row's pages gathered) is the same computation in torch.
        eager = sharktank_paged_prefill_attention(q, k, v, _table(pages, short).T, m.flatten().to(torch.int8), SCALE).double()
        assert bool(((eager - want).abs() <= bound).all())


class _Attend(torch.nn.Module):
    def forward(self, q, k_pool, v_pool, pages, mask):
        return ops.paged_attention(q, k_pool, v_pool, pages, mask, enable_gqa=True)


def _traced(length: int, paged) -> str:
    """The graph of ``ops.paged_attention`` traced for ``length`` queries a sequence (dynamic)
    over a pool of a dynamic page count, with ``paged`` as the paged kernel."""
    _, k, v, pages = _operands(4, 8, 2, torch.bfloat16, torch.float32, seed=3)
    k, v = (torch.where(t.isfinite(), t, 0) for t in (k, v))
    q = _queries(8, torch.float32, length, 3).unflatten(0, (B, length)).transpose(1, 2).contiguous()  # [B, H, L, E]
    mask = _masks(length)["causal"].unflatten(0, (B, length))[:, None]  # [B, 1, L, T]
    count, queries = torch.export.Dim("P", min=2), {2: torch.export.Dim("L", min=2)}
    dynamic = {"q": queries, "k_pool": {0: count}, "v_pool": {0: count}, "pages": None, "mask": queries}
    with ops.attention_kernels(None, paged):
        return str(torch.export.export(_Attend(), (q, k, v, pages, mask), dynamic_shapes=dynamic, strict=False).graph)


def test_export_takes_the_prefill_dispatch_for_a_prompt_chunk():
    graph = _traced(3, paged_attention)
    assert graph.count("turbine.sharktank_paged_prefill_attention.default") == 1
    assert "index_select" not in graph and "softmax" not in graph  # no gather, no torch attention
    # The decode kernel alone leaves a prompt to the torch form (the pages gathered).
    graph = _traced(3, paged_decode_attention)
    assert "sharktank_paged_prefill_attention" not in graph and "index_select" in graph


def test_traced_prefill_equals_the_torch_form_eagerly():
    """The offer's reshapes ([B, H, L, E] to rows and back, the table transposed, the mask to
    flat int8), run eagerly through the op's eager form, equal ops.paged_attention's torch
    form: over the whole tables, and over 11 pages of 4 (44 entries, not a multiple of 16)."""
    _, k, v, pages = _operands(4, 8, 2, torch.bfloat16, torch.float32, seed=6)
    k, v = (torch.where(t.isfinite(), t, 0).float() for t in (k, v))
    length = 5
    q = _queries(8, torch.float32, length, 6).unflatten(0, (B, length)).transpose(1, 2)
    for width in (T // 4, 11):
        mask = _masks(length, 4 * width)["holes"].unflatten(0, (B, length))[:, None]
        got = paged_prefill_attention(q, k, v, pages[:, :width], mask, SCALE)
        want = ops.paged_attention(q, k, v, pages[:, :width], mask, enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert paged_attention(q, k, v, pages, _masks(length)["holes"].unflatten(0, (B, length))[:, None], SCALE) is not None


@pytest.mark.parametrize(
    "what, change",
    [
        ("one query", lambda q, k, v, p, m: (q[:, :, :1], k, v, p, m[:, :, :1])),
        ("a mask per head", lambda q, k, v, p, m: (q, k, v, p, m.expand(B, 8, -1, T))),
        ("an additive mask", lambda q, k, v, p, m: (q, k, v, p, torch.zeros(m.shape))),
        ("an int32 table", lambda q, k, v, p, m: (q, k, v, p.int(), m)),
        ("a float64 query", lambda q, k, v, p, m: (q.double(), k, v, p, m)),
    ],
)
def test_other_forms_keep_the_torch_form(what, change):
    _, k, v, pages = _operands(4, 8, 2, torch.bfloat16, torch.float32, seed=5)
    q = _queries(8, torch.float32, 3, 5).unflatten(0, (B, 3)).transpose(1, 2)
    args = change(q, k, v, pages, _masks(3)["causal"].unflatten(0, (B, 3))[:, None])
    assert paged_prefill_attention(*args, SCALE) is None, what
