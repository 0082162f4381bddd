"""The hand-written decode-attention dispatch (export/kernels/attention.py), compiled, against
float64 attention computed here; and when export takes it (kernels.decode_attention).

One exported program holds the cases (one compile): grouped heads (4 query heads per KV
head) and plain heads, caches stored as bfloat16 and float32, causal masks at different
positions per sequence, and a mask with holes (a whole chunk of 16 false in the middle: a
chunk the dispatch skips, and entries inside a live chunk it must weigh 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharktank import ops
from sharktank.export import compile_mlir, export_function
from sharktank.export.kernels import attention, decode_attention
from sharktank.export.kernels.custom_op import sharktank_decode_attention
from sharktank.runtime import Session

B, T, E = 2, 48, 64  # three chunks of 16 entries
CASES = [  # (query heads, KV heads, cache dtype, q dtype)
    (8, 2, torch.bfloat16, torch.float32),
    (4, 4, torch.float32, torch.float32),
    (8, 2, torch.bfloat16, torch.bfloat16),
]
POSITIONS = torch.tensor([5, 40])  # the second sequence attends into the third chunk


def _masks() -> dict[str, torch.Tensor]:
    causal = torch.arange(T)[None] <= POSITIONS[:, None]
    holes = causal.clone()
    holes[1, 16:32] = False  # a whole chunk skipped
    holes[1, 3:9:2] = False  # entries of a live chunk left out
    holes[0, 0] = False
    return {"causal": causal, "holes": holes}


MASKS = _masks()


def _operands(h: int, kvh: int, kv: torch.dtype, qd: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, E, generator=g).to(qd)
    k = 2 * torch.randn(B, T, kvh, E, generator=g)  # scores of a few units: a peaked softmax
    v = torch.randn(B, T, kvh, E, generator=g)
    # Entries the "holes" mask leaves out hold what would stand out if they were weighed:
    # larger keys (scores), and in a live chunk larger values.
    k[1, 16:32] *= 4
    k[0, 0] *= 4
    v[1, 3:9:2] *= 100
    # And what is not a number, past the positions (masked in both masks): masked entries
    # are left out, not weighed 0 (0 * NaN is NaN), in a chunk the dispatch skips (the first
    # sequence's third) and in chunks it reads.
    k[0, 40], v[0, 41] = float("inf"), float("nan")
    k[0, 12], v[0, 10], v[1, 45] = float("nan"), float("nan"), float("inf")
    return q, k.to(kv), v.to(kv)


def _reference(q, k, v, mask, scale: float) -> torch.Tensor:
    b, h, e = q.shape
    kvh = k.shape[2]
    heads = torch.arange(h) // (h // kvh)
    dropped = ~mask[:, :, None, None]
    k, v = k.double().masked_fill(dropped, 0), v.double().masked_fill(dropped, 0)
    kk, vv = k[:, :, heads], v[:, :, heads]  # [B, T, H, E]
    s = torch.einsum("bhe,bthe->bht", q.double(), kk) * scale
    p = torch.softmax(s.masked_fill(~mask[:, None, :], float("-inf")), -1)
    return torch.einsum("bht,bthe->bhe", p, vv)


SCALE = E**-0.5


def _program(*args):
    out = []
    for i in range(len(CASES)):
        q, k, v = args[3 * i : 3 * i + 3]
        for name, mask in zip(MASKS, args[3 * len(CASES) :]):
            # float32 inputs (the runtime's numpy side has no bfloat16): cast here.
            h, kvh, kv, qd = CASES[i]
            y = sharktank_decode_attention(q.to(qd), k.to(kv), v.to(kv), mask, SCALE)
            out.append(y.float())
    return tuple(out)


@pytest.fixture(scope="module")
def compiled():
    ops_ = [_operands(*case, seed=i) for i, case in enumerate(CASES)]
    args = [t.float() for group in ops_ for t in group] + [m.to(torch.int8) for m in MASKS.values()]
    mlir = str(export_function(_program, tuple(args)).mlir_module)
    results = Session(compile_mlir(mlir, 1), 1).call("main", [a.numpy() for a in args], [0] * len(args))
    keys = [(i, name) for i in range(len(CASES)) for name in MASKS]
    return mlir, ops_, dict(zip(keys, (torch.from_numpy(np.asarray(r)) for r in results), strict=True))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"h{h}-kv{kvh}-{str(kv)[6:]}-q{str(qd)[6:]}" for h, kvh, kv, qd in CASES])
def test_dispatch_matches_attention_in_float64(compiled, case, mask):
    mlir, operands, results = compiled
    q, k, v = operands[case]
    h, kvh, kv, qd = CASES[case]
    assert f"util.call @{attention.function_name(B, h, T, kvh, E, *(str(d)[6:].replace('float32', 'f32').replace('bfloat16', 'bf16') for d in (qd, kv)), SCALE)}(" in mlir
    want = _reference(q, k, v, MASKS[mask], SCALE)
    got = results[(case, mask)].double()
    # float32 scores, softmax and sums (the cache's values as stored): summation order and the
    # exponential's rounding; a bfloat16 result adds its own rounding, 2^-8 of each value.
    bound = 1e-5 * want.abs().max() + (2.0**-8 * want.abs() if qd == torch.bfloat16 else 0)
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"max |error| {err.max().item():.3g}"
    # The custom op's eager form is the same computation in torch.
    eager = sharktank_decode_attention(q, k, v, MASKS[mask].to(torch.int8), SCALE).double()
    assert bool(((eager - want).abs() <= bound).all())


def test_export_takes_the_dispatch_for_one_query_with_a_boolean_mask():
    q, k, v = _operands(8, 2, torch.bfloat16, torch.float32, seed=3)
    k, v = (torch.where(t.isfinite(), t, 0) for t in (k, v))  # the torch form multiplies masked entries by 0
    q4, k4, v4 = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)  # [B, H, 1, E], [B, KVH, T, E]
    mask = MASKS["causal"][:, None, None, :]

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return ops.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)

    # Traced as export traces a program (non-strict: Python runs, and sees the context).
    with ops.attention_kernels(decode_attention):
        graph = str(torch.export.export(Attend(), (q4, k4, v4, mask), strict=False).graph)
    assert graph.count("turbine.sharktank_decode_attention.default") == 1 and "softmax" not in graph
    with ops.attention_kernels(None):
        assert "sharktank_decode_attention" not in str(torch.export.export(Attend(), (q4, k4, v4, mask), strict=False).graph)
    # Eagerly the op is the torch form: the kernel is offered traced operands only.
    with ops.attention_kernels(lambda *a: pytest.fail("offered an eager call")):
        eager = ops.scaled_dot_product_attention(q4, k4, v4, mask, enable_gqa=True)
    torch.testing.assert_close(eager[:, :, 0].double(), _reference(q, k.float(), v.float(), MASKS["causal"], SCALE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "what, change",
    [
        ("two queries", lambda q, k, v, m: (q.expand(B, 8, 2, E), k, v, m)),
        ("a cache length not a multiple of 16", lambda q, k, v, m: (q, k[:, :, :40], v[:, :, :40], m[..., :40])),
        ("a mask per head", lambda q, k, v, m: (q, k, v, m.expand(B, 8, 1, T))),
        ("an additive mask", lambda q, k, v, m: (q, k, v, torch.zeros(B, 1, 1, T))),
        ("a float64 query", lambda q, k, v, m: (q.double(), k, v, m)),
    ],
)
def test_other_forms_keep_the_torch_form(what, change):
    q, k, v = _operands(8, 2, torch.bfloat16, torch.float32, seed=5)
    args = change(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), MASKS["causal"][:, None, None, :])
    assert decode_attention(*args, SCALE) is None, what
