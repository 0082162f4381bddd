"""Sharded thetas on disk: per-device archives plus theta.json."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from placing import device_tuples, place

from sharktank.models.llama.config import LlamaConfig
from sharktank.types import ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor, is_deep_equal
from sharktank.models import load_theta, save_theta
from sharktank.weights import Theta, WeightsError, irpa_keys, load_irpa
from sharktank.weights import sharded_io

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def _theta() -> Theta:
    return Theta({
        "model.embed_tokens.weight": torch.randn(64, 32),
        "model.layers.0.self_attn.q_proj.weight": SplitPrimitiveTensor(
            shard_dim=0, ts=torch.randn(32, 32), devices=(5, 2), pinned=True, name="q0"),
        "model.layers.0.mlp.down_proj.weight": SplitPrimitiveTensor(
            shard_dim=1, ts=torch.randn(32, 47), devices=(0, 3, 1)),  # uneven: 16, 16, 15
        "cube": SplitPrimitiveTensor(shard_dim=2, ts=torch.randn(2, 3, 4).to(torch.bfloat16), devices=(2, 5)),
        "model.norm.weight": ReplicatedTensor(ts=torch.randn(32), devices=(1, 4)),
        "partial": UnreducedTensor(ts=[torch.randn(4, 4, dtype=torch.float16) for _ in range(2)], devices=(0, 3), pinned=True),
        "positions": torch.arange(10),
    })


def _assert_deep_equal(loaded: Theta, saved: Theta):
    assert list(loaded) == list(saved)
    for name in saved:
        assert is_deep_equal(loaded[name], saved[name], compare_placement=True), name
        if isinstance(saved[name], ShardedTensor):
            assert loaded[name].name == saved[name].name, name


def test_round_trip_restores_every_placement(tmp_path):
    theta = _theta()
    save_theta(tmp_path / "t", CONFIG, theta)
    config, loaded = load_theta(tmp_path / "t")
    assert config == CONFIG
    _assert_deep_equal(loaded, theta)
    assert loaded["model.layers.0.self_attn.q_proj.weight"].devices == (5, 2)
    assert loaded["model.layers.0.mlp.down_proj.weight"].shard_sizes == [16, 16, 15]


def test_each_device_file_holds_only_its_own_shards(tmp_path):
    theta = _theta()
    save_theta(tmp_path / "t", CONFIG, theta)
    files = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert files == ["device_0.irpa", "device_1.irpa", "device_2.irpa", "device_3.irpa", "device_4.irpa",
                     "device_5.irpa", "plain.irpa", "theta.json"]
    for device in range(6):
        expected = {n: t.shards[t.devices.index(device)] for n, t in theta.items()
                    if isinstance(t, ShardedTensor) and device in t.devices}
        stored = load_irpa(tmp_path / "t" / f"device_{device}.irpa")
        assert sorted(irpa_keys(tmp_path / "t" / f"device_{device}.irpa")) == sorted(expected)
        for name, shard in expected.items():
            assert torch.equal(stored[name], shard) and stored[name].dtype == shard.dtype, (device, name)
    assert sorted(irpa_keys(tmp_path / "t" / "plain.irpa")) == ["model.embed_tokens.weight", "positions"]


def test_manifest_describes_each_tensor_and_archive(tmp_path):
    save_theta(tmp_path / "t", CONFIG, _theta())
    manifest = json.loads((tmp_path / "t" / "theta.json").read_text())
    q = manifest["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q == {"kind": "split", "shard_dim": 0, "devices": [5, 2], "pinned": True, "name": "q0", "dtype": "float32",
                 "shape": [32, 32], "shards": [{"file": "device_5.irpa", "key": "model.layers.0.self_attn.q_proj.weight"},
                                               {"file": "device_2.irpa", "key": "model.layers.0.self_attn.q_proj.weight"}]}
    assert manifest["tensors"]["partial"]["kind"] == "unreduced" and manifest["tensors"]["positions"]["kind"] == "plain"
    assert manifest["tensors"]["model.norm.weight"]["kind"] == "replicated"
    assert manifest["config"] == CONFIG.to_dict()
    from sharktank.weights._files import sha256_file

    for file, info in manifest["archives"].items():
        assert info == {"size": os.path.getsize(tmp_path / "t" / file), "sha256": sha256_file(tmp_path / "t" / file)}


@settings(max_examples=25)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    devices=device_tuples(1, 4),
    data=st.data(),
    pinned=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
)
def test_round_trip_property(tmp_path_factory, shape, devices, data, pinned, dtype):
    kind = data.draw(st.sampled_from(["T", "R", "P"] + [f"S{d}" for d in range(len(shape))]))
    t = place((torch.randn(shape) * 10).to(dtype), kind, devices, pinned=pinned)
    directory = tmp_path_factory.mktemp("prop") / "t"
    save_theta(directory, CONFIG, Theta({"x": t}))
    _, loaded = load_theta(directory)
    assert is_deep_equal(loaded["x"], t, compare_placement=True)


# --- overwriting -------------------------------------------------------------------------


def test_save_replaces_a_previous_theta_and_leaves_no_temporaries(tmp_path):
    save_theta(tmp_path / "t", CONFIG, _theta())
    small = Theta({"only": ReplicatedTensor(ts=torch.ones(3), devices=(7,))})
    save_theta(tmp_path / "t", CONFIG, small)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["device_7.irpa", "theta.json"]
    _assert_deep_equal(load_theta(tmp_path / "t")[1], small)
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_save_refuses_to_replace_an_unrelated_directory(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="t"):
        save_theta(tmp_path / "t", CONFIG, _theta())
    assert (tmp_path / "t" / "notes.txt").read_text() == "keep me" and [p.name for p in tmp_path.iterdir()] == ["t"]


def test_failed_save_keeps_the_old_theta(tmp_path, monkeypatch):
    save_theta(tmp_path / "t", CONFIG, _theta())
    before = {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()}
    calls = []

    def failing_save_irpa(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_save_irpa(path, tensors, metadata)

    real_save_irpa = sharded_io.save_irpa
    monkeypatch.setattr(sharded_io, "save_irpa", failing_save_irpa)
    with pytest.raises(OSError, match="disk full"):
        save_theta(tmp_path / "t", CONFIG, Theta({"x": SplitPrimitiveTensor(shard_dim=0, ts=torch.ones(8), devices=(0, 1, 2))}))
    assert {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


# --- damaged directories -------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    save_theta(tmp_path / "t", CONFIG, _theta())
    return tmp_path / "t"


def _edit_manifest(directory, edit):
    manifest = json.loads((directory / "theta.json").read_text())
    edit(manifest)
    (directory / "theta.json").write_text(json.dumps(manifest))


def _expect_error(directory, *fragments):
    with pytest.raises(WeightsError) as err:
        load_theta(directory)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize("bad", ["../x.irpa", "sub/../../x.irpa", "/tmp/x.irpa"])
def test_archive_path_escaping_the_directory(saved, bad):
    (saved.parent / "x.irpa").write_bytes((saved / "device_0.irpa").read_bytes())
    _edit_manifest(saved, lambda m: m["archives"].update({bad: m["archives"]["device_0.irpa"]}))
    _expect_error(saved, "theta.json", bad)


def test_shard_path_escaping_the_directory(saved):
    def edit(m):
        m["tensors"]["partial"]["shards"][0]["file"] = "../device_0.irpa"

    _edit_manifest(saved, edit)
    _expect_error(saved, "theta.json", "../device_0.irpa")


def test_symlink_leading_outside(saved, tmp_path):
    (tmp_path / "elsewhere.irpa").write_bytes((saved / "device_0.irpa").read_bytes())
    (saved / "device_0.irpa").unlink()
    (saved / "device_0.irpa").symlink_to(tmp_path / "elsewhere.irpa")
    _expect_error(saved, "theta.json", "device_0.irpa", "outside")


def test_missing_archive(saved):
    (saved / "device_5.irpa").unlink()
    _expect_error(saved, "device_5.irpa", "missing")


def test_sha256_mismatch(saved):
    file = saved / "device_3.irpa"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01  # same size, different bytes
    file.write_bytes(bytes(data))
    _expect_error(saved, "device_3.irpa", "sha256")


@pytest.mark.parametrize("damage", ["truncated", "zero_length", "wrong_magic"])
def test_damaged_archive(saved, damage):
    file = saved / "device_2.irpa"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[:100], "zero_length": b"", "wrong_magic": b"XXXX" + data[4:]}[damage])
    _expect_error(saved, "device_2.irpa")


@pytest.mark.parametrize(
    "damage, fragments",
    [
        ("wrong_magic", ["theta.json", "manifest"]),
        ("truncated", ["theta.json", "not JSON"]),
        ("missing", ["theta.json", "not found"]),
        ("wrong_shape", ["theta.json", "cube", "[2, 3, 5]"]),
        ("unknown_kind", ["theta.json", "cube", "sliced"]),
        ("missing_key", ["device_5.irpa", "cube", "no-such-key"]),
    ],
)
def test_damaged_manifest(saved, damage, fragments):
    manifest = saved / "theta.json"
    text = manifest.read_text()
    if damage == "wrong_magic":
        manifest.write_text(text.replace("sharktank.theta", "other.format"))
    elif damage == "truncated":
        manifest.write_text(text[: len(text) // 2])
    elif damage == "missing":
        manifest.unlink()
    else:
        def edit(m):
            entry = m["tensors"]["cube"]
            if damage == "wrong_shape":
                entry["shape"] = [2, 3, 5]
            elif damage == "unknown_kind":
                entry["kind"] = "sliced"
            else:
                entry["shards"][1]["key"] = "no-such-key"

        _edit_manifest(saved, edit)
    _expect_error(saved, *fragments)


def test_a_save_killed_while_deleting_the_old_directory_leaves_no_readable_half(tmp_path, monkeypatch):
    """The replaced directory loses its manifest before anything else: a process that dies
    while deleting it (here: deletion stops after one more file) leaves a hidden directory
    that load_theta refuses, never one it would read with files missing."""
    from sharktank.weights import _files

    out = tmp_path / "theta"
    save_theta(out, CONFIG, _theta())

    def die_after_one_file(d, ignore_errors=False):
        if not os.path.exists(d):  # the build directory, already renamed into place
            return
        victim = sorted(p for p in os.listdir(d) if p != sharded_io.MANIFEST)[0]
        os.unlink(os.path.join(d, victim))
        raise KeyboardInterrupt  # killed mid-deletion

    monkeypatch.setattr(_files.shutil, "rmtree", die_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        save_theta(out, CONFIG, _theta())
    monkeypatch.undo()
    load_theta(out)  # the new directory is in place and complete
    (old,) = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert not (old / sharded_io.MANIFEST).exists()
    with pytest.raises(WeightsError):
        load_theta(old)
