"""ops.expert_ffn against a float64 loop over tokens: each form (grouped runs, gathered
experts, every expert weighted), a device's own experts, the sharded forms, quantized experts,
and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sharktank import ops
from sharktank.ops.experts import every, gathered, grouped
from sharktank.types import QuantizedTensor, ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor

E, K, HIDDEN, FFN = 6, 2, 32, 64


def _case(rows: int, seed: int = 0, unused=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=g)
    gate, up = (torch.randn(E, FFN, HIDDEN, generator=g) / 4 for _ in range(2))
    down = torch.randn(E, HIDDEN, FFN, generator=g) / 4
    allowed = [e for e in range(E) if e not in unused]
    experts = torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(rows)])
    weights = torch.rand(rows, K, generator=g)
    return x, weights, experts, gate, up, down


def _reference(x, weights, experts, gate, up, down, first=0, local=E):
    """float64, token by token; pairs outside ``first .. first + local`` contribute zero."""
    x, weights, gate, up, down = (t.double() for t in (x, weights, gate, up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            if first <= e < first + local:
                out[t] += weights[t, j] * (down[e] @ (F.silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    return out


def _err(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("form", [grouped, gathered, every])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_each_form_equals_the_token_loop(form, rows):
    case = _case(rows, seed=rows, unused=(1, 4))  # two experts no token chose: empty runs
    assert _err(form(*case), _reference(*case)) < 1e-6


@pytest.mark.parametrize("form", [grouped, gathered, every])
def test_a_devices_own_experts_leave_the_others_pairs_out(form):
    x, weights, experts, gate, up, down = _case(7, seed=3)
    got = form(x, weights, experts, gate[2:4], up[2:4], down[2:4], 2)
    assert _err(got, _reference(x, weights, experts, gate, up, down, first=2, local=2)) < 1e-6


def test_the_op_chooses_gathered_for_few_pairs_and_grouped_for_many():
    # Eager: fewer pairs than experts read only the chosen experts; more are grouped by expert.
    for rows in (1, 2, 9):
        case = _case(rows, seed=10 + rows)
        assert _err(ops.expert_ffn(*case), _reference(*case)) < 1e-6


@pytest.mark.parametrize("split", ["experts", "ffn", "replicated"])
def test_sharded_forms_equal_the_unsharded_op(split):
    x, weights, experts, gate, up, down = _case(8, seed=5)
    devices = (0, 1, 2)
    rep = [ReplicatedTensor(ts=t, devices=devices) for t in (x, weights, experts)]
    if split == "replicated":
        ws = [ReplicatedTensor(ts=w, devices=devices) for w in (gate, up, down)]
    else:
        dims = (0, 0, 0) if split == "experts" else (1, 1, 2)
        ws = [SplitPrimitiveTensor(shard_dim=d, ts=w, devices=devices) for d, w in zip(dims, (gate, up, down))]
    y = ops.expert_ffn(*rep, *ws)
    assert isinstance(y, ReplicatedTensor if split == "replicated" else UnreducedTensor)
    assert y.devices == devices
    want = _reference(x, weights, experts, gate, up, down)
    assert _err(ops.unshard(y), want) < 1e-6
    if split == "experts":
        # Whole experts per device: shard i holds only the pairs of experts 2i and 2i+1.
        for i, shard in enumerate(y.shards):
            assert _err(shard, _reference(x, weights, experts, gate, up, down, first=2 * i, local=2)) < 1e-6


def test_quantized_experts_equal_their_dequantized_weights():
    gguf = pytest.importorskip("gguf")
    x, weights, experts, gate, up, down = _case(9, seed=6)

    def q8(w):
        blocks = gguf.quants.quantize(w.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        return QuantizedTensor("Q8_0", w.shape, torch.from_numpy(blocks.reshape(-1)))

    qs = [q8(w) for w in (gate, up, down)]
    plain = [q.dequantize() for q in qs]
    want = _reference(x, weights, experts, *plain)
    for form in (grouped, gathered, every):
        assert _err(form(x, weights, experts, *qs), want) < 1e-6


def test_experts_split_unlike_each_other_are_refused():
    x, weights, experts, gate, up, down = _case(2)
    devices = (0, 1)
    rep = [ReplicatedTensor(ts=t, devices=devices) for t in (x, weights, experts)]
    ws = [SplitPrimitiveTensor(shard_dim=d, ts=w, devices=devices) for d, w in zip((0, 1, 2), (gate, up, down))]
    with pytest.raises(ops.ShardingError, match=r"split on \(0, 1, 2\)"):
        ops.expert_ffn(*rep, *ws)


def test_unpinned_experts_move_to_pinned_tokens():
    # The placement step runs before the op: unpinned experts go where pinned tokens are.
    x, weights, experts, gate, up, down = _case(5, seed=7)
    ws = [SplitPrimitiveTensor(shard_dim=0, ts=w, devices=(0, 1)) for w in (gate, up, down)]
    rep = [ReplicatedTensor(ts=t, devices=(2, 3), pinned=True) for t in (x, weights, experts)]
    with ops.record_transfers() as log:
        y = ops.expert_ffn(*rep, *ws)
    assert y.devices == (2, 3) and len(log) == 6  # 3 weights x 2 shards
    assert _err(ops.unshard(y), _reference(x, weights, experts, gate, up, down)) < 1e-6
