"""load_model from every source gives the transformers logits (sharded and not)."""

from __future__ import annotations

import pytest
import torch

from reference import assert_logits_match, hf_llama
from sharktank import ops
from sharktank.models import load_model, save_model_irpa
from sharktank.types import ShardedTensor, is_deep_equal
from sharktank.models import save_gguf, save_theta
from sharktank.weights import WeightsError

TOKENS = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    ref, config, theta = hf_llama()
    root = tmp_path_factory.mktemp("sources")
    ref.save_pretrained(root / "hf", max_shard_size="40KB")  # several files + index
    save_gguf(root / "model.gguf", config, theta)
    save_model_irpa(root / "model.irpa", config, theta)
    sharded = load_model(root / "hf", tp=2, pp=2)
    save_theta(root / "theta", config, _theta_of(sharded))
    with torch.no_grad():
        want = ref(TOKENS).logits
    return root, want


def _theta_of(model):
    from sharktank.weights import Theta

    out = {}
    for reps in model.stages:
        w = reps[0]
        for b, ws in w.blocks.items():
            for t in ws.values():
                out[t.name] = t
        for t in (w.embed, w.norm, w.lm_head):
            if t is not None:
                out[t.name] = t
    return Theta(out)


@pytest.mark.parametrize("kind", ["hf", "model.gguf", "model.irpa", "theta"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_every_source_matches_transformers(sources, kind, tp, pp):
    root, want = sources
    model = load_model(root / kind, tp=tp, pp=pp)
    assert_logits_match(model.prefill(TOKENS), want)


def test_sharded_save_keeps_placement(sources):
    from sharktank.models import load_theta

    root, _ = sources
    _, theta = load_theta(root / "theta")
    q = theta["model.layers.3.self_attn.q_proj.weight"]
    assert isinstance(q, ShardedTensor) and q.devices == (2, 3) and q.pinned and q.shard_dim == 0
    again = _theta_of(load_model(root / "hf", tp=2, pp=2))
    assert all(is_deep_equal(theta[k], again[k]) for k in again)


def test_toy_llama_is_deterministic_and_dtype_converts():
    a, b = load_model("toy-llama"), load_model("toy-llama", tp=2, pp=2)
    t = torch.tensor([[1, 2, 3, 4]])
    assert (a.prefill(t) - b.prefill(t)).abs().max().item() <= 1e-5
    assert torch.equal(a.generate(t, 4), b.generate(t, 4))
    half = load_model("toy-llama", dtype=torch.float16)
    assert half.prefill(t).dtype == torch.float16
    assert load_model("toy-llama", seed=1).prefill(t).sub(a.prefill(t)).abs().max() > 0.1


def test_placement_list_and_file(tmp_path):
    placement = [
        {"op": "place", "filter": {"PP": 0}, "devices": [0, 2]},
        {"op": "place", "filter": {"PP": 1}, "devices": [1, 3]},
    ]
    m = load_model("toy-llama", placement=placement)
    assert m.plan.pp == 2 and len(m.plan.paths) == 2
    t = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with ops.record_transfers() as log:
        got = m.prefill(t)
    assert (got - load_model("toy-llama").prefill(t)).abs().max().item() <= 1e-5
    # One boundary per microbatch, plus its positions to the second stage.
    assert sorted((x.src, x.dst) for x in log) == [(0, 1), (0, 1), (2, 3), (2, 3)]


def test_unknown_sources_are_clear_errors(tmp_path):
    with pytest.raises(WeightsError, match="no such model source"):
        load_model(tmp_path / "nope.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="neither config.json nor theta.json"):
        load_model(tmp_path / "empty")


def test_llama_cpp_rope_freqs_file_matches_the_llama3_model(tmp_path):
    # llama.cpp's converter stores Llama 3.1+'s llama3 scaling only as a rope_freqs tensor of
    # per-frequency divisors. Build those divisors from transformers' own llama3 frequencies,
    # write the file that way (no sharktank.rope_scaling.* keys) and load it: the logits are
    # the transformers llama3 model's, for positions past the original context as well.
    from dataclasses import replace

    from gguf import GGUFReader

    ref, config, theta = hf_llama(rope_scaling=True)
    scaled = ref.model.rotary_emb.inv_freq.float()
    head_dim = config.head_dim
    plain = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert not torch.allclose(plain, scaled)  # the scaling changes some frequencies
    factors = (plain / scaled).tolist()
    path = tmp_path / "llama3.gguf"
    save_gguf(path, replace(config, rope_scaling={"rope_type": "factors", "factors": factors}), theta)
    reader = GGUFReader(path)
    assert "rope_freqs.weight" in [t.name for t in reader.tensors]
    assert not [k for k in reader.fields if "rope_scaling" in k or "rope.scaling" in k]
    tokens = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(1))  # past 40 = the original context
    with torch.no_grad():
        want = ref(tokens).logits
    for tp in (1, 2):
        assert_logits_match(load_model(path, tp=tp).prefill(tokens), want)


def test_rope_freqs_of_the_wrong_size_is_refused(tmp_path):
    from dataclasses import replace

    _, config, theta = hf_llama(rope_scaling=True)
    path = tmp_path / "bad.gguf"
    save_gguf(path, replace(config, rope_scaling={"rope_type": "factors", "factors": [1.0] * 3}), theta)
    with pytest.raises(WeightsError, match=r"bad\.gguf.*rope_freqs\.weight.*expected float32 \[8\]"):
        load_model(path)
