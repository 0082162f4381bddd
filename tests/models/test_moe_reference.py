"""Mixtral and Qwen3-MoE against transformers: their checkpoints (one tensor per expert) and
GGUF files (stacked 3-D experts, as llama.cpp writes them) load into the Llama model, whose
mixture-of-experts blocks route as transformers does and match its logits and greedy ids,
unsharded, tensor-parallel (each expert split like the dense FFN) and expert-parallel over
the tensor-parallel group (whole experts per device), with pipeline stages."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from placing import all_reduce_transfers
from reference import QK_NORM_SCALE, QK_SCALE, assert_logits_match, logits_error
from sharktank import ops
from sharktank.layers import route
from sharktank.models import load_gguf, load_hf_checkpoint, load_model, save_gguf
from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.model import LlamaModel
from sharktank.parallel import ParallelPlan
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor
from sharktank.weights import WeightsError

TOKENS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))

# transformers' std-0.02 router gives logits of std ~0.15 over 4-8 experts: the k-th and
# (k+1)-th largest are often within 1e-3, where our rounding (1e-6) could pick another expert.
# Scaling the router by 10 spreads the logits (std ~1.5) while the second expert keeps a
# weight that matters (0.1+ on average); ROUTER_MARGIN is checked on every token.
ROUTER_SCALE = 10.0
ROUTER_MARGIN = 1e-3

_COMMON = dict(
    vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
KINDS = ["mixtral", "qwen3_moe", "qwen3_moe_unnormed"]


@functools.lru_cache(maxsize=None)
def hf_moe(kind: str, seed: int = 0, layers: int = 2, kv_heads: int = 2):
    """A tiny random transformers ``kind`` model of ``layers`` blocks and ``kv_heads`` KV heads (of 4 heads): Mixtral (4 experts of
    ffn 128, top 2) or Qwen3-MoE (8 experts of ffn 64, top 2, head_dim 32; ``_unnormed``:
    norm_topk_prob False; its dense intermediate_size is unused), with non-trivial norm
    weights, sharp attention and a sharp router."""
    import transformers

    torch.manual_seed(seed)
    common = {**_COMMON, "num_hidden_layers": layers, "num_key_value_heads": kv_heads}
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, head_dim=32,
            norm_topk_prob=kind == "qwen3_moe", rope_theta=1e6, **common))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(QK_NORM_SCALE)
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``kind -> save_pretrained directory`` of :func:`hf_moe` (per-expert tensors), made on first use."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = tmp_path_factory.mktemp(kind)
            hf_moe(kind).save_pretrained(made[kind])
        return made[kind]

    return get


def _router_calls(ref, tokens):
    """``[(router input, transformers' chosen experts)]`` per MoE block, and the logits."""
    calls = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: calls.append((args[0].reshape(-1, args[0].shape[-1]), out)))
        for layer in ref.model.layers
    ]
    with torch.no_grad():
        logits = ref(tokens).logits
    for h in hooks:
        h.remove()
    return calls, logits


def _prefill_matches(model, ref) -> list:
    """Assert ``model``'s prompt logits match transformers' ``ref``; returns the transfers recorded."""
    with ops.record_transfers() as log:
        got = model.prefill(TOKENS)
    with torch.no_grad():
        want = ref(TOKENS).logits
    assert_logits_match(got, want)
    return log


def test_config_from_the_checkpoints(checkpoint):
    mixtral, _ = load_hf_checkpoint(checkpoint("mixtral"))
    assert (mixtral.architecture, mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.intermediate_size) == ("llama", 4, 2, 128)
    qwen, theta = load_hf_checkpoint(checkpoint("qwen3_moe"))
    assert (qwen.architecture, qwen.num_experts, qwen.intermediate_size, qwen.norm_topk_prob) == ("qwen3moe", 8, 64, True)
    assert not load_hf_checkpoint(checkpoint("qwen3_moe_unnormed"))[0].norm_topk_prob
    # The per-expert tensors are stacked on the expert dim, in expert order.
    ref = hf_moe("qwen3_moe").model.layers[1].mlp.experts
    gate, up = ref.gate_up_proj.detach().chunk(2, dim=1)
    assert torch.equal(theta["model.layers.1.mlp.experts.gate_proj.weight"], gate)
    assert torch.equal(theta["model.layers.1.mlp.experts.up_proj.weight"], up)
    assert torch.equal(theta["model.layers.1.mlp.experts.down_proj.weight"], ref.down_proj.detach())


@pytest.mark.parametrize("kind", KINDS)
def test_routing_chooses_transformers_experts(checkpoint, kind):
    config, theta = load_hf_checkpoint(checkpoint(kind))
    calls, _ = _router_calls(hf_moe(kind), TOKENS)
    for i, (x, (logits, want_weights, want_experts)) in enumerate(calls):
        top = logits.topk(config.num_experts_per_tok + 1, dim=-1).values
        assert (top[:, -2] - top[:, -1]).min() > ROUTER_MARGIN  # no near-tie decides a choice
        weights, experts = route(ops.linear(x, theta[f"model.layers.{i}.mlp.gate.weight"]), config.num_experts_per_tok,
                                 config.family.routing, config.norm_topk_prob)
        assert torch.equal(experts, want_experts)
        torch.testing.assert_close(weights, want_weights.float(), rtol=1e-6, atol=1e-7)
        assert weights[:, -1].mean() > 0.1  # the second expert's weight is not negligible


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp, pp, experts", [(1, 1, "ffn"), (2, 1, "ffn"), (2, 2, "ffn"), (2, 1, "experts"), (2, 2, "experts"), (4, 1, "experts")])
def test_logits_match_transformers(checkpoint, tmp_path, kind, tp, pp, experts):
    if tp == 4:  # attention split 4-way needs 4 KV heads (ep = tp: experts over the tensor-parallel group)
        ref = hf_moe(kind, kv_heads=4)
        ref.save_pretrained(tmp_path)
        config, theta = load_hf_checkpoint(tmp_path)
    else:
        ref = hf_moe(kind)
        config, theta = load_hf_checkpoint(checkpoint(kind))
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, tp, pp), experts=experts)
    log = _prefill_matches(model, ref)
    # The experts add no transfer to a dense block's: one all_reduce after attention, one after
    # the FFN, whether each expert is split (ffn) or the experts are (expert parallelism).
    inputs = 2 * (tp - 1) + (pp - 1) * tp
    assert len(log) == config.num_layers * 2 * all_reduce_transfers(tp) + (pp - 1) * tp + (tp - 1) + inputs


DUALPIPEV = Path(__file__).resolve().parents[2] / "exports" / "placements" / "dualpipev-pp4-dp2.json"


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_dualpipev_over_moe_stages_matches_transformers(tmp_path, kind):
    # Four MoE blocks in DualPipeV's four stages over two devices per path (stage s and 3 - s
    # share one), two paths: each batch row is one microbatch on its own path.
    ref = hf_moe(kind, layers=4)
    ref.save_pretrained(tmp_path / "moe")
    model = load_model(tmp_path / "moe", placement=DUALPIPEV)
    log = _prefill_matches(model, ref)
    # The experts add no transfer to the placement's: a dense model of the same layout moves
    # as much.
    import transformers

    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=128, **{**_COMMON, "num_hidden_layers": 4}))
    dense.save_pretrained(tmp_path / "dense")
    with ops.record_transfers() as dense_log:
        load_model(tmp_path / "dense", placement=DUALPIPEV).prefill(TOKENS)
    assert len(log) == len(dense_log) > 0
    with torch.no_grad():
        want_ids = ref.generate(TOKENS[:, :6], max_new_tokens=4, do_sample=False)[:, 6:]
    assert torch.equal(model.generate(TOKENS[:, :6], 4), want_ids)


def test_experts_are_split_like_the_dense_ffn(checkpoint):
    config, theta = load_hf_checkpoint(checkpoint("mixtral"))
    w = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, 2, 1)).stages[0][0].blocks[0]
    assert isinstance(w["router"], ReplicatedTensor) and w["router"].pinned
    for name, dim in (("experts_gate", 1), ("experts_up", 1), ("experts_down", 2)):
        assert isinstance(w[name], SplitPrimitiveTensor) and w[name].shard_dim == dim and w[name].devices == (0, 1)
        assert w[name].shards[0].shape[0] == config.num_experts  # every device holds every expert's slice


def test_expert_parallel_weights_are_whole_experts(checkpoint):
    config, theta = load_hf_checkpoint(checkpoint("qwen3_moe"))
    model = load_model(checkpoint("qwen3_moe"), tp=2, ep=2)
    w = model.stages[0][0].blocks[1]
    for name, full in (("experts_gate", "gate_proj"), ("experts_down", "down_proj")):
        assert isinstance(w[name], SplitPrimitiveTensor) and w[name].shard_dim == 0 and list(w[name].shard_sizes) == [4, 4]
        assert torch.equal(w[name].shards[1], theta[f"model.layers.1.mlp.experts.{full}.weight"][4:])
    # Attention stays tensor-parallel over the same devices.
    assert isinstance(w["q"], SplitPrimitiveTensor) and w["q"].shard_dim == 0 and w["q"].devices == (0, 1)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("ep, pp", [(2, 1), (4, 1), (2, 2)])
def test_expert_parallelism_alone_matches_transformers(checkpoint, kind, ep, pp):
    # tp 1, ep devices per stage: whole experts per device, every other weight and the cache
    # replicated (ep 4 with 2 KV heads, which tensor-parallel attention could not split).
    ref = hf_moe(kind)
    model = load_model(checkpoint(kind), ep=ep, pp=pp)
    config = model.config
    w = model.stages[0][0].blocks[0]
    assert isinstance(w["experts_up"], SplitPrimitiveTensor) and w["experts_up"].shard_dim == 0 and len(w["experts_up"].shards) == ep
    assert all(isinstance(w[n], ReplicatedTensor) and w[n].devices == tuple(range(ep)) for n in ("q", "k", "v", "o", "router"))
    assert isinstance(model.stages[-1][0].lm_head, ReplicatedTensor)
    assert all(isinstance(t, ReplicatedTensor) for t in model.new_cache(1, 8).entries[0][0])
    log = _prefill_matches(model, ref)
    # One collective per block, the experts' combine (attention needs none, nor the LM head),
    # plus the stage boundaries' copies and the inputs (tokens, positions) to the other devices.
    inputs = 2 * (ep - 1) + (pp - 1) * ep
    assert len(log) == config.num_layers * all_reduce_transfers(ep) + (pp - 1) * ep + inputs
    prompt = TOKENS[:1, :6]
    with torch.no_grad():
        want_ids = ref.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, 6), want_ids[:, prompt.shape[1]:])


@pytest.mark.parametrize("rows", [1, 3])
def test_the_three_expert_forms_agree_on_a_checkpoint(checkpoint, rows):
    # Decode reads only the chosen experts (in place, or each once); prefill groups the tokens
    # by expert (ops.expert_ffn): on a real block's weights and routing the forms agree to
    # rounding, and the op split over 2 devices (each expert's ffn, or whole experts) too.
    from sharktank.ops.experts import every, gathered, grouped

    config, theta = load_hf_checkpoint(checkpoint("qwen3_moe"))
    p = "model.layers.0.mlp."
    names = ("gate.weight", "experts.gate_proj.weight", "experts.up_proj.weight", "experts.down_proj.weight")
    router, *ws = [theta[p + n] for n in names]
    x = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(4))
    weights, experts = route(ops.linear(x, router), config.num_experts_per_tok, config.family.routing, config.norm_topk_prob)
    want = grouped(x, weights, experts, *ws)
    for form in (gathered, every):
        assert logits_error(form(x, weights, experts, *ws), want) < 1e-6
    devices = (0, 1)
    rep = [ReplicatedTensor(ts=t, devices=devices) for t in (x, weights, experts)]
    for dims in ((1, 1, 2), (0, 0, 0)):
        split = [SplitPrimitiveTensor(shard_dim=d, ts=w, devices=devices) for d, w in zip(dims, ws)]
        assert logits_error(ops.unshard(ops.expert_ffn(*rep, *split)), want) < 1e-6


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe_unnormed"])
@pytest.mark.parametrize("tp, experts", [(1, "ffn"), (2, "ffn"), (2, "experts")])
def test_greedy_generation_matches_transformers(checkpoint, kind, tp, experts):
    # Decode steps of one token: rows * k < E, so only the chosen experts are gathered (with
    # the expert dim split, each device computes its own experts for the token).
    ref = hf_moe(kind)
    config, theta = load_hf_checkpoint(checkpoint(kind))
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, tp, 1), experts=experts)
    prompt = TOKENS[:1, :6]
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, 8), want[:, prompt.shape[1]:])


# --- GGUF ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe"), ("qwen3_moe_unnormed", "qwen3moe")])
def test_gguf_round_trip_of_the_checkpoint(checkpoint, tmp_path, kind, arch):
    from gguf import GGUFReader

    config, theta = load_hf_checkpoint(checkpoint(kind))
    save_gguf(tmp_path / "m.gguf", config, theta)
    reader = GGUFReader(tmp_path / "m.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == arch
    assert (fields[f"{arch}.expert_count"], fields[f"{arch}.expert_used_count"]) == (config.num_experts, config.num_experts_per_tok)
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml order: fastest dim first
    e, f, h = config.num_experts, config.intermediate_size, config.hidden_size
    assert shapes["blk.0.ffn_gate_inp.weight"] == (h, e)
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (h, f, e)
    assert shapes["blk.1.ffn_down_exps.weight"] == (f, h, e)
    del reader
    config2, theta2 = load_gguf(tmp_path / "m.gguf")
    assert config2 == config
    assert list(theta2) == list(theta) and all(torch.equal(theta2[n], theta[n]) for n in theta)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_gguf_model_equals_the_checkpoint_model(checkpoint, tmp_path, kind):
    ckpt = checkpoint(kind)
    save_gguf(tmp_path / "m.gguf", *load_hf_checkpoint(ckpt))
    got = load_model(tmp_path / "m.gguf", tp=2).prefill(TOKENS)
    assert torch.equal(got, load_model(ckpt, tp=2).prefill(TOKENS))
    with torch.no_grad():
        assert_logits_match(got, hf_moe(kind)(TOKENS).logits)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_half_precision_gguf_loads(checkpoint, tmp_path, kind):
    config, theta = load_hf_checkpoint(checkpoint(kind))
    half = theta.map(lambda _, t: t.to(torch.float16))
    save_gguf(tmp_path / "m.gguf", config, half)
    _, back = load_gguf(tmp_path / "m.gguf")
    assert all(back[n].dtype == torch.float16 and torch.equal(back[n], half[n]) for n in half)


@pytest.mark.parametrize("kind, tp", [("mixtral", 1), ("qwen3_moe", 2)])
def test_q8_0_experts_equal_their_dequantized_weights(checkpoint, tmp_path, kind, tp):
    # quantize_gguf writes the stacked experts as 3-D Q8_0 (the router stays float32, as
    # llama.cpp keeps it); the model computes on the blocks as the gguf package expands them,
    # tensor-parallel too (each expert's ffn halves, 64 and 32, are whole Q8_0 blocks).
    from quantized_models import gguf_dequantized
    from sharktank.models import hf_checkpoint_source, quantize_gguf
    from sharktank.types import QuantizedTensor

    config, source = hf_checkpoint_source(checkpoint(kind))
    counts = quantize_gguf(tmp_path / "q.gguf", config, source, to="q8_0")
    assert counts["F32"] == 1 + config.num_layers * (3 + 2 * config.family.qk_norm)  # norms and routers
    config2, theta = load_gguf(tmp_path / "q.gguf")
    assert config2 == config
    gate = theta["model.layers.1.mlp.experts.gate_proj.weight"]
    assert isinstance(gate, QuantizedTensor) and gate.layout.name == "Q8_0" and gate.shape == (config.num_experts, config.intermediate_size, config.hidden_size)
    assert theta["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    plan = ParallelPlan.from_tp_pp(config.num_layers, tp, 1)
    model, oracle = LlamaModel(config, theta, plan), LlamaModel(config, gguf_dequantized(theta), plan)
    assert_logits_match(model.prefill(TOKENS), oracle.prefill(TOKENS))
    prompt = TOKENS[:1, :6]
    assert torch.equal(model.generate(prompt, 8), oracle.generate(prompt, 8))  # decode gathers quantized experts


# --- refused -------------------------------------------------------------------------------

_HF = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=5), r"num_experts_per_tok=5 must be in 1\.\.num_experts=4"),
        (dict(model_type="mixtral", num_experts_per_tok=2), r"model_type 'mixtral' needs num_local_experts \(or num_experts\) and num_experts_per_tok"),
        (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1]),
         r"dense blocks among the MoE ones are not supported: mlp_only_layers=\[1\], decoder_sparse_step=1"),
    ],
)
def test_bad_moe_configs_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf({**_HF, **extra})


def test_experts_of_a_dense_family_are_refused():
    with pytest.raises(ValueError, match=r"architecture 'qwen2' has no mixture-of-experts form \(num_experts=4\); MoE families: llama, qwen3moe"):
        LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                    architecture="qwen2", num_experts=4, num_experts_per_tok=2)


def test_expert_parallelism_needs_whole_experts_per_device():
    import dataclasses

    from sharktank.models.llama.presets import random_theta
    from sharktank.parallel import PlanError

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                         num_experts=3, num_experts_per_tok=2)
    plan = ParallelPlan.from_tp_pp(1, 2, 1)
    with pytest.raises(PlanError, match=r"ep=2: num_experts=3 is not divisible by 2 \(whole experts per device\)"):
        LlamaModel(config, random_theta(config), plan, experts="experts")
    LlamaModel(config, random_theta(config), plan)  # each expert split instead: fine
    dense = dataclasses.replace(config, num_experts=0, num_experts_per_tok=0)
    with pytest.raises(PlanError, match="expert parallelism needs a mixture-of-experts model"):
        LlamaModel(dense, random_theta(dense), plan, experts="experts")
    with pytest.raises(PlanError, match="expert parallelism needs a mixture-of-experts model"):
        load_model("toy-llama", ep=2)  # ep alone (tp 1) of a dense model
    with pytest.raises(PlanError, match=r"ep=4 with tp=2: ep must be 1, equal tp \(experts split over the tensor-parallel group\) "
                       r"or go with tp=1 \(expert parallelism alone, on ep devices per stage\)"):
        load_model("toy-llama", tp=2, ep=4)
    with pytest.raises(PlanError, match="replicated dense weights go with expert parallelism"):
        LlamaModel(config, random_theta(config), plan, dense="replicated")


def test_gguf_with_more_used_experts_than_experts_is_refused(checkpoint, tmp_path):
    from sharktank.models.llama.gguf_config import gguf_metadata
    from sharktank.models.llama.gguf_names import to_gguf_name
    from sharktank.weights import tensor_entry, write_gguf

    config, theta = load_hf_checkpoint(checkpoint("mixtral"))
    metadata = {**gguf_metadata(config), "llama.expert_used_count": ("uint32", 5)}
    entries = [tensor_entry(to_gguf_name(n), t, lambda t=t: t, path=tmp_path) for n, t in theta.items()]
    write_gguf(tmp_path / "w.gguf", "llama", metadata, entries)
    with pytest.raises(WeightsError) as err:
        load_gguf(tmp_path / "w.gguf")
    assert str(err.value) == f"{tmp_path / 'w.gguf'}: llama.expert_used_count=5 must be in 1..llama.expert_count=4"


def test_checkpoint_missing_an_expert_names_it(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = shutil.copytree(checkpoint("mixtral"), tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model.safetensors: tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight': missing"):
        load_hf_checkpoint(ckpt)
