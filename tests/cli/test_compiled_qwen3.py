"""A Qwen3 checkpoint (per-head q/k norms, head_dim != hidden / heads, tied embeddings) compiled
tp=2 x pp=2 on four CPU local-task devices: logits and ids match eager, transfers match Llama's."""

from __future__ import annotations

import torch

from sharktank.export.artifact import export_artifact
from sharktank.models import load_model
from sharktank.runtime import CompiledModel
from sharktank.weights import irpa_keys


def _checkpoint(path):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # norms that are not all ones, so a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def test_compiled_qwen3_matches_eager(tmp_path):
    ckpt = _checkpoint(tmp_path / "hf")
    model = load_model(ckpt, tp=2, pp=2)
    assert model.config.architecture == "qwen3" and model.config.head_dim == 16 != 32 // 4
    assert model.config.tie_word_embeddings
    manifest = export_artifact(model, tmp_path / "art", source=str(ckpt), batch_sizes=(1,), max_seq_len=16)
    # 2 blocks x 2 all_reduces x 2, one stage boundary of 2 shards, the LM-head gather, tokens
    # to device 1 and positions to devices 1, 2 and 3: the replicated q/k norms move nothing.
    # prefill_chunk moves its cache row index to devices 1, 2 and 3 as well, and the prefills
    # their kept positions to the last stage's devices 2 and 3.
    assert manifest.transfers == {"prefill_bs1": 8 + 2 + 1 + 4 + 2, "decode_bs1": 8 + 2 + 1 + 4, "prefill_chunk_bs1": 8 + 2 + 1 + 4 + 3 + 2}
    # Each device's archive holds its block's norms whole (replicated), block 1's on stage 1.
    for device, block in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        keys = irpa_keys(tmp_path / "art" / f"device_{device}.irpa")
        assert {f"model.layers.{block}.self_attn.{n}_norm.weight@d{device}" for n in "qk"} <= set(keys), keys
        assert not any(f"layers.{1 - block}." in k for k in keys)
    compiled = CompiledModel(tmp_path / "art")
    tokens = torch.tensor([[3, 14, 15, 9, 2, 6]])

    logits, cache = compiled.prefill(tokens)
    eager_cache = model.new_cache(1, 16)
    want = model.prefill(tokens, eager_cache)
    assert (logits - want).abs().max().item() <= 1e-4
    nxt = want[:, -1].argmax(-1)
    pos = torch.full((1,), tokens.shape[1])
    got, _ = compiled.decode(nxt, cache, pos)
    assert (got - model.decode(nxt, eager_cache, pos)).abs().max().item() <= 1e-4
    ids, _ = compiled.generate(tokens, 6)
    assert torch.equal(ids, model.generate(tokens, 6))
