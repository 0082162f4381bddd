"""Sharded ops traced by iree-turbine: transfers in the MLIR, compiled and run on CPU devices."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from placing import all_reduce_transfers
from sharktank import ops
from sharktank.export import arg_devices, compile_mlir, count_transfers, export_function
from sharktank.runtime import Session
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, UnreducedTensor


def _mlir(fn, *args) -> str:
    return str(export_function(fn, args).mlir_module)


def _arg_affinities(mlir: str) -> list[int]:
    sig = re.search(r"func\.func @main\((.*?)\) ->", mlir, re.S).group(1)
    return [int(d) for d in re.findall(r"@__device_(\d+)>", sig)]


@pytest.mark.parametrize("n", [2, 4])
def test_collective_transfer_counts_in_mlir(n):
    t = torch.randn(n * 3, 5)
    devices = tuple(reversed(range(n)))
    split = SplitPrimitiveTensor(shard_dim=0, ts=t, devices=devices)
    partial = UnreducedTensor(ts=[torch.randn(n * 3, 5) for _ in range(n)], devices=devices)
    assert count_transfers(_mlir(lambda x: ops.all_gather(x), split)) == n * (n - 1)
    assert count_transfers(_mlir(lambda x: ops.all_reduce(x), partial)) == all_reduce_transfers(n)
    assert count_transfers(_mlir(lambda x: ops.reduce_scatter(x, 0), partial)) == n * (n - 1)


def test_argument_affinity_comes_from_tensor_devices():
    x = SplitPrimitiveTensor(shard_dim=1, ts=torch.randn(2, 6), devices=(2, 0, 1))
    y = ReplicatedTensor(ts=torch.randn(2, 1), devices=(2, 0, 1))
    assert arg_devices((x, y)) == [2, 0, 1, 2, 0, 1]
    mlir = _mlir(lambda a, b: ops.add(a, b), x, y)
    assert _arg_affinities(mlir) == [2, 0, 1, 2, 0, 1]
    assert count_transfers(mlir) == 0


def test_transfer_if_needed_emits_transfers_to_pinned_devices():
    w = SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(4, 8), devices=(2, 3), pinned=True)
    x = ReplicatedTensor(ts=torch.randn(3, 8), devices=(0, 1))
    mlir = _mlir(lambda a, b: ops.linear(a, b), x, w)
    targets = re.findall(r"flow\.tensor\.transfer .* to #hal\.device\.promise<@__device_(\d+)>", mlir)
    assert sorted(int(d) for d in targets) == [2, 3]


def _tp_ffn(x, w_up, w_down):
    return ops.all_reduce(ops.linear(ops.elementwise(F.silu, ops.linear(x, w_up)), w_down))


@pytest.mark.parametrize("devices", [(0, 1), (1, 0)])
def test_tp_ffn_compiles_and_runs_like_eager(devices):
    n = len(devices)
    x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    args = (
        ReplicatedTensor(ts=[x.clone() for _ in range(n)], devices=devices),
        SplitPrimitiveTensor(shard_dim=0, ts=w1, devices=devices),
        SplitPrimitiveTensor(shard_dim=1, ts=w2, devices=devices),
    )
    eager = _tp_ffn(*args)
    mlir = _mlir(_tp_ffn, *args)
    assert count_transfers(mlir) == all_reduce_transfers(n)
    session = Session(compile_mlir(mlir, n), n)
    flat = [s for a in args for s in a.shards]
    results = session.call("main", [s.numpy() for s in flat], arg_devices(args))
    assert len(results) == n
    for got, want in zip(results, eager.shards, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    reference = F.linear(F.silu(F.linear(x, w1)), w2).numpy()
    np.testing.assert_allclose(results[0], reference, rtol=1e-4, atol=1e-4)


def test_two_stage_pipeline_compiles_and_runs_like_eager():
    x = torch.randn(2, 8)
    weights = [(torch.randn(16, 8), torch.randn(8, 16)) for _ in range(2)]
    stages = [
        (
            SplitPrimitiveTensor(shard_dim=0, ts=a, devices=(2 * s, 2 * s + 1), pinned=True),
            SplitPrimitiveTensor(shard_dim=1, ts=b, devices=(2 * s, 2 * s + 1), pinned=True),
        )
        for s, (a, b) in enumerate(weights)
    ]

    def forward(h, w0a, w0b, w1a, w1b):
        return _tp_ffn(_tp_ffn(h, w0a, w0b), w1a, w1b)

    args = (ReplicatedTensor(ts=[x.clone(), x.clone()], devices=(0, 1)), *stages[0], *stages[1])
    with ops.record_transfers() as log:
        eager = forward(*args)
    assert eager.devices == (2, 3)
    mlir = _mlir(forward, *args)
    # Two all_reduces of 2 shards (2 transfers each: a swap) and the stage boundary (2 shards).
    assert count_transfers(mlir) == len(log) == 2 + 2 + 2
    session = Session(compile_mlir(mlir, 4), 4)
    flat = [s for a in args for s in a.shards]
    results = session.call("main", [s.numpy() for s in flat], arg_devices(args))
    for got, want in zip(results, eager.shards, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target, flag", [("cuda", "--iree-cuda-target=sm_80"), ("hip", "--iree-hip-target=gfx942")])
def test_gpu_targets_compile(target, flag):
    # No GPU here: this checks the target table's flags produce a module (running needs a GPU).
    from sharktank.export import compile_flags

    args = (
        ReplicatedTensor(ts=[torch.randn(4, 8) for _ in range(2)], devices=(0, 1)),
        SplitPrimitiveTensor(shard_dim=0, ts=torch.randn(16, 8), devices=(0, 1)),
        SplitPrimitiveTensor(shard_dim=1, ts=torch.randn(8, 16), devices=(0, 1)),
    )
    flags = compile_flags(2, target)
    assert flag in flags and f"--iree-hal-target-device={target}[1]" in flags
    assert len(compile_mlir(_mlir(_tp_ffn, *args), 2, target)) > 1000


def test_export_writes_attention_as_products_on_request():
    import dataclasses

    from sharktank.export.llama import export_llama
    from sharktank.models.llama.model import LlamaModel
    from sharktank.models.llama.presets import PRESETS, random_theta

    config = dataclasses.replace(PRESETS["toy-llama"], num_layers=1)
    model = LlamaModel(config, random_theta(config))
    fused = str(export_llama(model, (1,), 16)[0].mlir_module)
    unfused = str(export_llama(model, (1,), 16, attention_as_matmuls=True)[0].mlir_module)
    assert fused.count("torch.aten.scaled_dot_product_attention") == 3  # prefill, decode, prefill_chunk
    assert "scaled_dot_product_attention" not in unfused and "torch.aten.softmax" in unfused
    parts = re.split(r"func\.func (?:public |private )?@(\w+)", unfused)
    funcs = dict(zip(parts[1::2], parts[2::2]))
    assert set(funcs) == {"prefill_bs1", "decode_bs1", "prefill_chunk_bs1"}
    # GQA (8 query heads, 4 KV heads): decode stacks each KV head's queries, so its cache
    # is not repeated; only the prompt functions (a dynamic length) repeat it.
    prompt = [funcs["prefill_bs1"], funcs["prefill_chunk_bs1"]]
    decode = funcs["decode_bs1"]
    assert all("torch.aten.repeat_interleave" in f for f in prompt) and "torch.aten.repeat" not in decode
    # Prompts: both attention products; decode: scores as multiply-and-sum, values a product.
    assert all(f.count("torch.aten.matmul") == 2 for f in prompt) and decode.count("torch.aten.matmul") == 1
    assert "torch.aten.sum.dim_IntList" in decode


@pytest.mark.parametrize("tp", [1, 2])
def test_model_without_gqa_exports_and_runs_like_eager(tmp_path, tp):
    # As many KV heads as query heads (most older checkpoints): q and the cache then go
    # through the aligned-operands path, which must not guard the prompt length against the
    # cache length (torch.export refused the dynamic length before).
    import dataclasses

    from sharktank.export.artifact import export_artifact
    from sharktank.models.llama.model import LlamaModel
    from sharktank.models.llama.presets import PRESETS, random_theta
    from sharktank.parallel import ParallelPlan
    from sharktank.runtime import CompiledModel

    config = dataclasses.replace(PRESETS["toy-llama"], num_layers=1, num_kv_heads=PRESETS["toy-llama"].num_heads)
    model = LlamaModel(config, random_theta(config), ParallelPlan.from_tp_pp(1, tp, 1))
    export_artifact(model, tmp_path / "art", source="toy-llama (1 block, no GQA)", max_seq_len=16, functions=("prefill", "decode"))
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    ids, logits = CompiledModel(tmp_path / "art").generate(tokens, 4)
    assert torch.equal(ids, model.generate(tokens, 4))
    want = model.prefill(torch.cat([tokens, ids[:, :-1]], 1))[:, tokens.shape[1] - 1 :]
    assert (logits - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tp", [1, 2])
def test_batched_prefill_as_long_as_the_cache_exports_and_runs_like_eager(tmp_path, tp):
    # Prefill attends over its own S cache entries. A view of that symbolic length made
    # torch.export guard S against the cache length for batch > 1 and refused the export;
    # one KV head per shard is the layout where no other dim decides the view's contiguity.
    import dataclasses

    from sharktank.export.artifact import export_artifact
    from sharktank.models.llama.model import LlamaModel
    from sharktank.models.llama.presets import PRESETS, random_theta
    from sharktank.parallel import ParallelPlan
    from sharktank.runtime import CompiledModel

    config = dataclasses.replace(PRESETS["toy-llama"], num_layers=1, num_kv_heads=tp)
    model = LlamaModel(config, random_theta(config), ParallelPlan.from_tp_pp(1, tp, 1))
    export_artifact(model, tmp_path / "art", source="toy-llama (1 block, 1 KV head per shard)", batch_sizes=(2,), max_seq_len=16, functions=("prefill", "decode"))
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    got, _ = CompiledModel(tmp_path / "art").prefill(tokens)
    want = model.prefill(tokens)
    assert got.shape == want.shape == (2, 16, config.vocab_size)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("target", ["cuda", "hip"])
def test_gpu_targets_compile_a_whole_model(tmp_path, target):
    # No GPU here: the exported model (attention as products) compiles for the GPU targets.
    # IREE 3.10 fails on the fused attention op for both, so this guards the export choice.
    import dataclasses
    import json

    from sharktank.export.artifact import export_artifact
    from sharktank.models.llama.model import LlamaModel
    from sharktank.models.llama.presets import PRESETS, random_theta
    from sharktank.parallel import ParallelPlan

    config = dataclasses.replace(PRESETS["toy-llama"], num_layers=1)
    model = LlamaModel(config, random_theta(config), ParallelPlan.from_tp_pp(1, 2, 1))
    manifest = export_artifact(model, tmp_path / "art", source="toy-llama (1 block)", max_seq_len=16, target=target, functions=("prefill", "decode"))
    assert manifest.compile["driver"] == target and manifest.module["vmfb_size"] > 1000
    assert "scaled_dot_product_attention" not in (tmp_path / "art" / "model.mlir").read_text()
    assert json.loads((tmp_path / "art" / "manifest.json").read_text())["device_count"] == 2


def test_absent_dialect_module_misses_are_immediate_and_undone():
    import importlib
    import sys

    from sharktank.export.llama import _absent_dialect_modules

    name = "iree.compiler.dialects.torch"
    assert name not in sys.modules
    with _absent_dialect_modules(name, "iree.compiler.dialects"):  # the second one exists: left alone
        assert sys.modules[name] is None
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
        assert sys.modules["iree.compiler.dialects"] is not None
    assert name not in sys.modules


def test_only_the_known_spurious_compiler_message_is_dropped():
    from sharktank.export.compile import drop_known_noise

    noise = (
        "<stdin>:44:3: error: immutable global '@__auto.model.embed_tokens.weight@d0__timepoint' is initialized both by "
        "initial value and by store in initializer\n"
        '  util.global private @"__auto.model.embed_tokens.weight@d0" = #flow.parameter.named<"model"::"e"> : tensor<8x4xf32>\n'
        "  ^\n"
    )
    other = "<stdin>:7:1: error: immutable global '@w' is initialized both by initial value and by store in initializer\n  ^\n"
    warning = "<stdin>:9:1: warning: something else\n"
    assert drop_known_noise(noise + warning + noise) == warning
    assert drop_known_noise(other) == other  # not a timepoint global: kept


def test_a_cache_whose_shards_alias_is_refused():
    # Traced as one argument, two devices' shards would share a buffer in the program while
    # the runtime passes each device its own (a decode that reads what another device wrote).
    from sharktank.export.llama import _flat_cache
    from sharktank.models import load_model
    from sharktank.models.llama.model import KVCache

    model = load_model("toy-llama")
    one = torch.zeros(1, 8, 4, 16)
    aliased = KVCache(paths=[0], rows=[(0, 1)], entries=[[(ReplicatedTensor(ts=one, devices=(0, 1)),)]])
    with pytest.raises(ValueError, match="the cache's shards must be distinct tensors"):
        _flat_cache(aliased)
    leaves, _, devices = _flat_cache(model.new_cache(1, 8))
    assert len({id(x) for x in leaves}) == len(leaves) and devices == [0] * len(leaves)
