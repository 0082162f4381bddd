"""The dispatcher: typed public ops, type-based selection, clear errors, import lightness."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from sharktank import ops
from sharktank.ops import sharded_op
from sharktank.types import ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor

PUBLIC_OPS = [
    "reshard_split", "replicate", "reshard", "reshard_like", "unshard", "all_gather", "all_reduce",
    "reduce_scatter", "sharded_cat", "sharded_sum", "transfer_to_logical_device",
    "barrier_on_logical_device", "equal", "matmul", "linear", "elementwise", "cat", "reshape", "view",
    "flatten", "unflatten", "transpose", "permute", "expand", "index_select", "take_along_dim", "embedding_lookup",
    "softmax", "rms_norm", "layer_norm", "scaled_dot_product_attention", "paged_attention", "sum", "mean", "argmax", "to", "index_put",
    "add", "sub", "mul", "div",
]


@pytest.mark.parametrize("name", PUBLIC_OPS)
def test_public_op_is_a_typed_documented_function(name):
    op = getattr(ops, name)
    assert inspect.isfunction(op)
    assert op.__name__ == name and name in ops.__all__
    assert op.__doc__ and len(op.__doc__.strip()) > 20
    sig = inspect.signature(op)
    assert list(sig.parameters)[0] != "args"
    assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD)
    assert name in ops.registered_ops()


def test_missing_combination_lists_types_and_registrations():
    with pytest.raises(ops.NoImplementationError) as e:
        ops.sharded_cat(ReplicatedTensor(ts=torch.ones(2), shard_count=2))
    assert "ops.sharded_cat" in str(e.value) and "(ReplicatedTensor)" in str(e.value)
    assert "registered: (SplitPrimitiveTensor)" in str(e.value)
    assert isinstance(e.value, TypeError)


def test_most_specific_registration_wins_and_subclasses_match():
    @sharded_op()
    def probe(t: object) -> str:
        """Which implementation ran (test op)."""

    probe.register(ShardedTensor)(lambda t: "sharded")
    probe.register(SplitPrimitiveTensor)(lambda t: "split")
    probe.register(object)(lambda t: "any")

    class MySplit(SplitPrimitiveTensor):
        __slots__ = ()

    split = SplitPrimitiveTensor(shard_dim=0, ts=torch.ones(2), shard_count=2)
    assert probe(split) == "split"
    assert probe(MySplit(shard_dim=0, ts=torch.ones(2), shard_count=2)) == "split"
    assert probe(UnreducedTensor(ts=[torch.ones(2)])) == "sharded"
    assert probe(3) == "any"
    assert probe.dispatcher.cache[(SplitPrimitiveTensor,)] is not None


def test_dispatch_arguments_may_be_keywords():
    a = torch.randn(2, 3)
    w = torch.randn(4, 3)
    torch.testing.assert_close(ops.linear(x=a, weight=w), a @ w.T)
    torch.testing.assert_close(ops.matmul(a, rhs=w, transpose_rhs=True), a @ w.T)


def test_sharded_tensor_methods_and_operators_go_through_ops():
    t = torch.randn(4, 6)
    x = SplitPrimitiveTensor(shard_dim=0, ts=t, shard_count=2)
    r = ReplicatedTensor(ts=torch.randn(6, 3), shard_count=2)
    checks = [
        (x + 1, t + 1), (1 - x, 1 - t), (x * 2, t * 2), (x / 2, t / 2), (-x, -t), (2 / (x.to(torch.float64) + 10), 2 / (t.double() + 10)),
        (x @ r, t @ ops.unshard(r)), (x.T, t.T), (x.transpose(0, 1), t.T), (x.reshape(2, 2, 6), t.reshape(2, 2, 6)),
        (x.view(-1), t.view(-1)), (x.flatten(), t.flatten()), (x.permute(1, 0), t.permute(1, 0)),
        (x.sum(1), t.sum(1)), (x.mean(), t.mean()), (x.softmax(1), t.softmax(1)), (x.argmax(1), t.argmax(1)),
    ]
    for got, want in checks:
        torch.testing.assert_close(ops.unshard(got), want)
    assert ops.equal(x, t) and not ops.equal(x, t + 1)
    with pytest.raises(TypeError, match="ambiguous"):
        bool(x)


def test_import_of_ops_does_not_import_iree():
    code = "import sys, sharktank.ops; bad=[m for m in sys.modules if m.startswith(('iree', 'iree.turbine'))]; print(bad); assert not bad"
    subprocess.run([sys.executable, "-c", code], check=True)
