"""The sharded Llama against transformers, for every tensor x pipeline placement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference import assert_logits_match, hf_llama
from placing import all_reduce_transfers
from sharktank import ops
from sharktank.layers import rotary_cos_sin
from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.model import LlamaModel
from sharktank.parallel import ParallelPlan, PlanError, plan_from_directives

SHARED = Path(__file__).resolve().parents[2] / "exports" / "placements"  # copies of shared/placements
# Two prompts of 48 tokens: positions past the llama3 variant's original context (40).
TOKENS = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))


def _reference_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_logits_match_transformers(tp, pp):
    ref, config, theta = hf_llama()
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, tp, pp))
    with ops.record_transfers() as log:
        got = model.prefill(TOKENS)
    assert_logits_match(got, _reference_logits(ref, TOKENS))
    # Transfers are exactly: two all_reduces per block, the stage boundaries, the LM-head
    # gather, and the inputs copied from the first device to the others that read them
    # (tokens to the first stage's other devices, positions to every stage's devices).
    per_all_reduce = all_reduce_transfers(tp)
    inputs = (tp - 1) + (tp - 1) + (pp - 1) * tp
    assert len(log) == config.num_layers * 2 * per_all_reduce + (pp - 1) * tp + (tp - 1) + inputs
    assert sum(t.shape == tuple(TOKENS.shape) and t.dtype == torch.int64 for t in log) == inputs


@pytest.mark.parametrize("kv_heads, tp", [(1, 1), (8, 1), (8, 2)])
def test_multi_query_and_full_kv_heads_match_transformers(kv_heads, tp):
    # One KV head (multi-query: its reshape may name any dim of one shard) and as many KV
    # heads as query heads (no grouping), eager and sharded, decode after prefill.
    ref, config, theta = hf_llama(num_layers=2, kv_heads=kv_heads)
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, tp, 1))
    assert_logits_match(model.prefill(TOKENS), _reference_logits(ref, TOKENS))
    assert torch.equal(model.generate(TOKENS[:1], 4), ref.generate(TOKENS[:1], max_new_tokens=4, do_sample=False)[:, TOKENS.shape[1] :])


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_with_attention_and_mlp_biases_matches_transformers(tp):
    # attention_bias gives q, k, v and o biases, mlp_bias gate, up and down: the row-parallel
    # ones (o, down) are added once to the partial sums.
    ref, config, theta = hf_llama(num_layers=2, biases=True)
    assert config.attention_bias and config.o_bias and config.mlp_bias
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, tp, 1))
    assert_logits_match(model.prefill(TOKENS), _reference_logits(ref, TOKENS))


def test_dualpipev_placement_matches_transformers():
    ref, config, theta = hf_llama(num_layers=8)
    plan = plan_from_directives(SHARED / "dualpipev-pp8-dp2.json", num_blocks=8)
    model = LlamaModel(config, theta, plan)
    with ops.record_transfers() as log:
        got = model.prefill(TOKENS)  # two microbatches, one per path
    assert_logits_match(got, _reference_logits(ref, TOKENS))
    # Each V crosses 6 boundaries (3->3 stays on one device) with one shard (tp=1), and its
    # positions go from its first device to the 3 others it visits.
    assert len(log) == 2 * (6 + 3)
    assert {t.src for t in log} | {t.dst for t in log} == set(range(8))


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_greedy_generation_matches_transformers(tp, pp):
    ref, config, theta = hf_llama()
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, tp, pp))
    prompt = TOKENS[:1, :6]
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, 16), want[:, prompt.shape[1] :])


def test_decode_steps_match_full_prefill():
    ref, config, theta = hf_llama()
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, 2, 2))
    cache = model.new_cache(2, 32)
    model.prefill(TOKENS[:, :6], cache)
    steps = [model.decode(TOKENS[:, i], cache, torch.full((2,), i)) for i in range(6, 10)]
    assert_logits_match(torch.cat(steps, dim=1), _reference_logits(ref, TOKENS[:, :10])[:, 6:10])


@pytest.mark.parametrize("variant", ["llama3_rope", "qwen2_bias"])
def test_variants_match_transformers(variant):
    ref, config, theta = hf_llama(rope_scaling=variant == "llama3_rope", qwen=variant == "qwen2_bias")
    assert (config.rope_scaling is not None) == (variant == "llama3_rope")
    assert config.attention_bias == (variant == "qwen2_bias")
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, 2, 2))
    assert_logits_match(model.prefill(TOKENS), _reference_logits(ref, TOKENS))


@pytest.mark.parametrize("variant", ["default", "llama3_rope", "qwen2_bias"])
def test_rotary_tables_match_transformers(variant):
    # The logits only see rotary angles relative to each other (a shift of every position
    # cancels in q.k), so the tables themselves are compared: cos and sin of every position
    # the model can hold, from the inverse frequencies the model uses.
    ref, config, theta = hf_llama(rope_scaling=variant == "llama3_rope", qwen=variant == "qwen2_bias")
    positions = torch.arange(config.max_seq_len)[None, :]
    with torch.no_grad():
        want = ref.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    got = rotary_cos_sin(positions, LlamaModel(config, theta).inv_freq, torch.float32)
    for g, w in zip(got, want):  # ours broadcast over heads: [1, S, 1, head_dim]
        # Equal today; 1e-5 allows a frequency 1 ulp off (angle 63 moves ~4e-6), where a
        # wrong base, scaling or position moves some entry by 0.4 or more.
        torch.testing.assert_close(g[:, :, 0], w, atol=1e-5, rtol=0)


def test_sharded_gradients_match_unsharded():
    _, config, theta = hf_llama()
    params = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
    from sharktank.weights import Theta

    grads = []
    for tp, pp in [(1, 1), (2, 2)]:
        for p in params.values():
            p.grad = None
        model = LlamaModel(config, Theta(params), ParallelPlan.from_tp_pp(config.num_layers, tp, pp))
        model.prefill(TOKENS).square().mean().backward()
        grads.append({k: p.grad.clone() for k, p in params.items()})
    for k in params:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-4, msg=k)
    assert grads[0]["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_tp_must_divide_kv_heads():
    _, config, theta = hf_llama()
    with pytest.raises(PlanError, match="tp=3 must divide num_heads=8 and num_kv_heads=4"):
        LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, 3, 1))


def test_bad_inputs_are_clear_errors():
    _, config, theta = hf_llama()
    model = LlamaModel(config, theta)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        model.prefill(torch.tensor([[1, 64]]))
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="past the cache length 4"):
        model.prefill(torch.tensor([[1, 2, 3, 4, 5]]), cache)
    with pytest.raises(ValueError, match="positions must be >= 0, found -1"):
        model.decode(torch.tensor([1]), cache, torch.tensor([-1]))
    assert isinstance(config, LlamaConfig)
