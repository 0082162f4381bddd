"""Qwen2, Qwen3 and Mistral files: Hugging Face checkpoints and GGUF (architectures qwen2,
qwen3 and llama) load as transformers holds the model; sliding-window attention is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from reference import assert_logits_match, hf_family
from sharktank.models import load_gguf, load_hf_checkpoint, load_model, save_gguf
from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.gguf_config import gguf_metadata
from sharktank.models.llama.gguf_names import to_gguf_name
from sharktank.weights import WeightsError, tensor_entry, write_gguf

TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(kind, tie) -> save_pretrained directory`` of :func:`hf_family`, made on first use."""
    made = {}

    def get(kind: str, tie: bool = False):
        if (kind, tie) not in made:
            path = tmp_path_factory.mktemp(f"{kind}_tie{int(tie)}")
            hf_family(kind, tie=tie)[0].save_pretrained(path)
            made[(kind, tie)] = path
        return made[(kind, tie)]

    return get


def _assert_same(got, want):
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("kind, tie", [("qwen2", False), ("qwen3", False), ("qwen3", True), ("mistral", False)])
def test_hf_checkpoint_loads_the_reference(checkpoints, kind, tie):
    _, config, theta = hf_family(kind, tie=tie)
    got_config, got = load_hf_checkpoint(checkpoints(kind, tie))
    assert got_config == config and got_config.architecture == ARCH[kind]
    _assert_same(got, {n: theta[n] for n in got})  # in model order
    assert set(got) == set(theta)


@pytest.mark.parametrize("kind, tie", [("qwen2", False), ("qwen3", False), ("qwen3", True), ("mistral", False)])
def test_gguf_round_trip_of_the_hf_checkpoint(checkpoints, tmp_path, kind, tie):
    config, theta = load_hf_checkpoint(checkpoints(kind, tie))
    save_gguf(tmp_path / "m.gguf", config, theta)
    config2, theta2 = load_gguf(tmp_path / "m.gguf")
    assert config2 == config
    _assert_same(theta2, theta)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_gguf_uses_the_architecture_names_keys_and_q_order(checkpoints, tmp_path, kind):
    config, theta = load_hf_checkpoint(checkpoints(kind))
    save_gguf(tmp_path / "m.gguf", config, theta)
    reader = GGUFReader(tmp_path / "m.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    arch = ARCH[kind]
    assert fields["general.architecture"] == arch and fields[f"{arch}.block_count"] == 2
    assert fields[f"{arch}.attention.key_length"] == config.head_dim == (32 if kind == "qwen3" else 16)
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    assert ("blk.0.attn_q_norm.weight" in raw) == ("blk.1.attn_k_norm.weight" in raw) == (kind == "qwen3")
    if kind == "qwen3":
        assert torch.equal(raw["blk.1.attn_k_norm.weight"], theta["model.layers.1.self_attn.k_norm.weight"])
    # llama.cpp interleaves q/k rows for its llama rope only; qwen2/qwen3 use the NEOX rope (HF's order).
    q = theta["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(raw["blk.0.attn_q.weight"], q) == (arch != "llama")
    if kind == "qwen2":
        assert torch.equal(raw["blk.0.attn_k.bias"], theta["model.layers.0.self_attn.k_proj.bias"])


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_gguf_model_matches_transformers_like_the_checkpoint(checkpoints, tmp_path, kind):
    ref, _, _ = hf_family(kind, tie=kind == "qwen3")
    ckpt = checkpoints(kind, kind == "qwen3")
    save_gguf(tmp_path / "m.gguf", *load_hf_checkpoint(ckpt))
    from_gguf = load_model(tmp_path / "m.gguf", tp=2, pp=2).prefill(TOKENS)
    assert torch.equal(from_gguf, load_model(ckpt, tp=2, pp=2).prefill(TOKENS))
    with torch.no_grad():
        assert_logits_match(from_gguf, ref(TOKENS).logits)


# --- refused -------------------------------------------------------------------------------

_HF = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


@pytest.mark.parametrize(
    "extra, refused",
    [
        (dict(model_type="mistral", sliding_window=16), True),
        (dict(model_type="mistral", sliding_window=4096), False),  # wider than any position: full attention
        (dict(model_type="mistral", sliding_window=None), False),
        (dict(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1), True),
        # Qwen2.5's config.json form: a window, not used; or used only from layer 28 on.
        (dict(model_type="qwen2", sliding_window=16, use_sliding_window=False), False),
        (dict(model_type="qwen3", sliding_window=16, use_sliding_window=True), False),
        (dict(model_type="qwen3", sliding_window=16, layer_types=["full_attention", "sliding_attention"]), True),
    ],
)
def test_sliding_window_attention_is_refused(extra, refused):
    if not refused:
        assert LlamaConfig.from_hf({**_HF, **extra}).max_seq_len == 64
        return
    with pytest.raises(ValueError, match=r"sliding-window attention is not supported: sliding_window=16 is smaller than max_position_embeddings=64"):
        LlamaConfig.from_hf({**_HF, **extra})


def test_sliding_window_checkpoint_names_the_file_and_window(checkpoints, tmp_path):
    ckpt = shutil.copytree(checkpoints("mistral"), tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "sliding_window": 32}))
    with pytest.raises(WeightsError, match=r"config.json: .*sliding_window=32 is smaller than max_position_embeddings=64"):
        load_model(ckpt)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("attention.sliding_window", 16, "sliding-window attention is not supported: qwen3.attention.sliding_window=16 is smaller than qwen3.context_length=64"),
        ("attention.sliding_window", 64, None),  # the whole context: full attention
        ("rope.dimension_count", 16, "qwen3.rope.dimension_count=16: rotary embedding of part of a head is not supported (head_dim 32)"),
    ],
)
def test_gguf_metadata_this_model_cannot_follow_is_refused(checkpoints, tmp_path, key, value, message):
    config, theta = load_hf_checkpoint(checkpoints("qwen3"))
    metadata = {**gguf_metadata(config), f"qwen3.{key}": ("uint32", value)}
    entries = [tensor_entry(to_gguf_name(n), t, lambda t=t: t, path=tmp_path) for n, t in theta.items()]
    write_gguf(tmp_path / "w.gguf", "qwen3", metadata, entries)
    if message is None:
        assert load_gguf(tmp_path / "w.gguf")[0] == config
        return
    with pytest.raises(WeightsError) as err:
        load_gguf(tmp_path / "w.gguf")
    assert str(err.value) == f"{tmp_path / 'w.gguf'}: {message}"


def test_unknown_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported; supported: llama, mistral, qwen2, qwen3"):
        LlamaConfig.from_hf({**_HF, "model_type": "gemma"})
