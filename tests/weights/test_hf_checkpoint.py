"""Loading Hugging Face Llama checkpoints, good and damaged."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from sharktank.models import load_hf_checkpoint
from sharktank.weights import WeightsError


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _assert_matches_model(theta, model):
    expected = model.state_dict()
    assert set(theta) == set(expected)
    for name, t in expected.items():
        assert theta[name].dtype == t.dtype, name
        assert torch.equal(theta[name], t), name


def test_single_file_checkpoint_matches_state_dict(hf_model, hf_checkpoint):
    config, theta = load_hf_checkpoint(hf_checkpoint)
    _assert_matches_model(theta, hf_model)
    hf = hf_model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (64, 32, 48)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 8)
    assert config.max_seq_len == 64 and config.rms_norm_eps == hf.rms_norm_eps and config.rope_theta == 10000.0
    assert config.rope_scaling is None and not config.attention_bias and not config.tie_word_embeddings
    assert next(iter(theta)) == "model.embed_tokens.weight"  # model order, not file order


def test_sharded_checkpoint_matches_state_dict(hf_model, hf_sharded_checkpoint):
    files = sorted(p.name for p in hf_sharded_checkpoint.glob("model-*.safetensors"))
    assert len(files) > 1 and (hf_sharded_checkpoint / "model.safetensors.index.json").is_file()
    config, theta = load_hf_checkpoint(hf_sharded_checkpoint)
    _assert_matches_model(theta, hf_model)
    assert config.num_layers == 2


def test_rotary_buffers_are_ignored(hf_model, hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, ckpt / "model.safetensors")
    _, theta = load_hf_checkpoint(ckpt)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in theta
    _assert_matches_model(theta, hf_model)


@pytest.mark.parametrize("keep_lm_head", [False, True])
def test_tied_embeddings_have_no_lm_head(hf_checkpoint, tmp_path, keep_lm_head):
    ckpt = _copy(hf_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (ckpt / "config.json").write_text(json.dumps(cfg))
    if not keep_lm_head:
        tensors = load_file(ckpt / "model.safetensors")
        del tensors["lm_head.weight"]
        save_file(tensors, ckpt / "model.safetensors")
    config, theta = load_hf_checkpoint(ckpt)
    assert config.tie_word_embeddings and "lm_head.weight" not in theta and len(theta) == 20


# --- damaged checkpoints ------------------------------------------------------------------


def _expect_error(ckpt, *fragments):
    with pytest.raises(WeightsError) as err:
        load_hf_checkpoint(ckpt)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))
    return err.value


def _edit_tensors(ckpt, edit):
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")


def test_shape_disagreeing_with_config(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(8, 32)}))
    err = _expect_error(ckpt, "model.safetensors", "model.layers.1.self_attn.k_proj.weight", "[8, 32]", "[16, 32]")
    assert err.tensor == "model.layers.1.self_attn.k_proj.weight"


def test_config_disagreeing_with_tensors(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _expect_error(ckpt, "model.safetensors", "mlp.gate_proj.weight", "[40, 32]")


def test_missing_tensor(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    _edit_tensors(ckpt, lambda t: t.pop("model.norm.weight"))
    _expect_error(ckpt, "model.safetensors", "model.norm.weight", "missing")


def test_unexpected_tensor(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(32)}))
    _expect_error(ckpt, "model.safetensors", "model.layers.2.input_layernorm.weight", "unexpected")


@pytest.mark.parametrize("damage", ["truncated", "zero_length", "wrong_magic", "header_length"])
def test_damaged_safetensors_file(hf_checkpoint, tmp_path, damage):
    ckpt = _copy(hf_checkpoint, tmp_path)
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "zero_length": b"",
        "wrong_magic": b"GGUF\x03\x00\x00\x00" + data[8:],  # the first 8 bytes are the header size
        "header_length": struct.pack("<Q", struct.unpack("<Q", data[:8])[0] + 8) + data[8:],
    }[damage]
    file.write_bytes(damaged)
    assert _expect_error(ckpt, "model.safetensors").path == str(file)


def test_every_bit_flip_in_the_tensor_header_is_caught(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    header = data[8:header_end].decode()
    # The free-form __metadata__ value is not checked by anyone: flips there are harmless.
    meta_start = 8 + header.index('"__metadata__"')
    meta_end = 8 + header.index("}", meta_start - 8) + 1
    positions = [p for p in range(0, header_end, 7) if not meta_start <= p < meta_end]
    assert len(positions) > 100
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (pos % 8 if pos >= 8 else 3)
        file.write_bytes(bytes(flipped))
        with pytest.raises(WeightsError, match="model.safetensors"):
            load_hf_checkpoint(ckpt)


def test_missing_shard_file(hf_sharded_checkpoint, tmp_path):
    ckpt = _copy(hf_sharded_checkpoint, tmp_path)
    victim = sorted(ckpt.glob("model-*.safetensors"))[1]
    victim.unlink()
    _expect_error(ckpt, victim.name, "not found")


def test_truncated_shard_file(hf_sharded_checkpoint, tmp_path):
    ckpt = _copy(hf_sharded_checkpoint, tmp_path)
    victim = sorted(ckpt.glob("model-*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    _expect_error(ckpt, victim.name)


def test_index_naming_a_tensor_its_file_lacks(hf_sharded_checkpoint, tmp_path):
    ckpt = _copy(hf_sharded_checkpoint, tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    first_file = sorted(set(index["weight_map"].values()))[0]
    other = next(n for n, f in index["weight_map"].items() if f != first_file)
    index["weight_map"][other] = first_file
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(ckpt, first_file, other, "not in this file")


@pytest.mark.parametrize("bad_path", ["../outside.safetensors", "/etc/passwd"])
def test_index_path_outside_the_checkpoint(hf_sharded_checkpoint, tmp_path, bad_path):
    ckpt = _copy(hf_sharded_checkpoint, tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = bad_path
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(ckpt, "model.safetensors.index.json", bad_path)


def test_missing_config_and_missing_weights(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    (ckpt / "model.safetensors").unlink()
    _expect_error(ckpt, "model.safetensors")
    (ckpt / "config.json").unlink()
    _expect_error(ckpt, "config.json")


def test_corrupt_config_json(hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path)
    (ckpt / "config.json").write_text('{"vocab_size": 64,')
    _expect_error(ckpt, "config.json")
