"""Eager ops are differentiable; a replicate's backward sums the replicas' gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharktank import ops
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor


def test_replicate_backward_sums_replica_gradients():
    t = torch.randn(3, 4, requires_grad=True)
    r = ops.replicate(t, count=3)
    loss = sum((s * (i + 1)).sum() for i, s in enumerate(r.shards))
    loss.backward()
    torch.testing.assert_close(t.grad, torch.full((3, 4), 1.0 + 2.0 + 3.0))


def test_tensor_parallel_ffn_gradients_match_torch():
    x = torch.randn(4, 8)
    w1 = torch.randn(16, 8, requires_grad=True)
    w2 = torch.randn(8, 16, requires_grad=True)
    F.linear(F.silu(F.linear(x, w1)), w2).square().sum().backward()
    g1, g2 = w1.grad.clone(), w2.grad.clone()
    w1.grad = w2.grad = None

    xs = ReplicatedTensor(ts=x, shard_count=4)
    w1s = SplitPrimitiveTensor(shard_dim=0, ts=w1, shard_count=4)
    w2s = SplitPrimitiveTensor(shard_dim=1, ts=w2, shard_count=4)
    y = ops.all_reduce(ops.linear(ops.elementwise(F.silu, ops.linear(xs, w1s)), w2s))
    # Every replica holds the same loss; one replica's loss is the model's loss.
    y.shards[0].square().sum().backward()
    torch.testing.assert_close(w1.grad, g1, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w2.grad, g2, atol=1e-4, rtol=1e-4)
