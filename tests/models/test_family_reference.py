"""Qwen2, Qwen3 and Mistral (the Llama family's other members) against transformers, sharded
tensor- and pipeline-parallel; Qwen3's per-head q/k norms placed with their block."""

from __future__ import annotations

import pytest
import torch

from reference import assert_logits_match, hf_family, logits_error
from placing import all_reduce_transfers
from sharktank import ops
from sharktank.models.llama.model import LlamaModel
from sharktank.parallel import ParallelPlan
from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor
from sharktank.weights import Theta

TOKENS = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))


def _reference_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("kind, architecture", [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("mistral", "llama")])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_match_transformers(kind, architecture, tp, pp):
    ref, config, theta = hf_family(kind)
    assert config.architecture == architecture  # Mistral is the llama layout (as llama.cpp converts it)
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, tp, pp))
    with ops.record_transfers() as log:
        got = model.prefill(TOKENS)
    assert_logits_match(got, _reference_logits(ref, TOKENS))
    # The q/k norms add no transfer: two all_reduces per block, the stage boundaries, the
    # LM-head gather and the inputs, as for Llama.
    inputs = 2 * (tp - 1) + (pp - 1) * tp
    assert len(log) == config.num_layers * 2 * all_reduce_transfers(tp) + (pp - 1) * tp + (tp - 1) + inputs


def test_qwen3_config_and_layout():
    _, config, theta = hf_family("qwen3")
    # head_dim 32 with hidden 64 over 4 heads: q is [4 * 32, 64], not [64, 64].
    assert config.head_dim == 32 != config.hidden_size // config.num_heads
    assert config.family.qk_norm and not config.attention_bias and not config.o_bias
    assert theta["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert theta["model.layers.1.self_attn.k_norm.weight"].shape == (32,)


def test_qwen3_norms_are_replicated_with_their_block():
    _, config, theta = hf_family("qwen3")
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, 2, 2))
    for stage, block, devices in [(0, 0, (0, 1)), (1, 1, (2, 3))]:
        w = model.stages[stage][0].blocks[block]
        for name in ("q_norm", "k_norm"):
            assert isinstance(w[name], ReplicatedTensor) and w[name].devices == devices and w[name].pinned
            assert all(torch.equal(s, theta[f"model.layers.{block}.self_attn.{name}.weight"]) for s in w[name].shards)
        assert isinstance(w["q"], SplitPrimitiveTensor) and w["q"].shard_dim == 0 and w["q"].devices == devices


def test_qwen3_norms_change_the_logits():
    # The check above could pass with the norms ignored: drop them (weights of one, which
    # still normalize) and the logits move far past the tolerance.
    ref, config, theta = hf_family("qwen3")
    ones = Theta({k: torch.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in theta.items()})
    err = logits_error(LlamaModel(config, ones).prefill(TOKENS), _reference_logits(ref, TOKENS))
    assert err > 1e-2


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tied_embeddings_match_transformers(kind):
    ref, config, theta = hf_family(kind, tie=True)
    assert config.tie_word_embeddings and "lm_head.weight" not in theta
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, 2, 2))
    assert_logits_match(model.prefill(TOKENS), _reference_logits(ref, TOKENS))


def test_qwen3_greedy_generation_matches_transformers():
    # Decode steps (one position at a time, the cache holding normalized, rotated keys).
    ref, config, theta = hf_family("qwen3")
    model = LlamaModel(config, theta, ParallelPlan.from_tp_pp(config.num_layers, 2, 1))
    prompt = TOKENS[:1, :6]
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, 12), want[:, prompt.shape[1] :])
