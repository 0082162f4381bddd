"""tools/make_checkpoint.py: sharded HF checkpoints that transformers and sharktank load alike,
seeded per tensor, written all or nothing, in bounded memory; and the bytes bench_limits counts."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import make_checkpoint  # noqa: E402
from bench_limits import weight_bytes_per_token  # noqa: E402
from make_checkpoint import CONFIGS, cached_checkpoint, write_checkpoint  # noqa: E402

from sharktank.models.llama.config import LlamaConfig  # noqa: E402
from sharktank.models import load_hf_checkpoint  # noqa: E402
from sharktank.models.llama.layout import llama_shapes  # noqa: E402

SHARD = 60_000  # tiny is 214 kB in bfloat16: four files, the embedding (65.5 kB) alone in one


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                assert name not in out, f"{name} in two files"
                out[name] = f.get_tensor(name)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ck") / "tiny"
    write_checkpoint(out, "tiny", "bfloat16", seed=0, shard_size=SHARD, log=None)
    return out


def test_index_lists_every_tensor_once_and_files_respect_the_shard_size(tiny):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tiny.glob("*.safetensors"))
    assert len(files) == 4 and files[0] == "model-00001-of-00004.safetensors"
    assert not (tiny / "model.safetensors").exists()
    shapes = llama_shapes(LlamaConfig.from_hf(json.loads((tiny / "config.json").read_text())))
    tensors = _tensors(tiny)
    assert list(index["weight_map"]) == list(shapes)  # model order, each name once
    assert set(tensors) == set(shapes) and sorted(set(index["weight_map"].values())) == files
    for name, file in index["weight_map"].items():
        with safe_open(str(tiny / file), framework="pt") as f:
            assert name in f.keys()
        assert tuple(tensors[name].shape) == shapes[name] and tensors[name].dtype == torch.bfloat16
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for file in files:
        with safe_open(str(tiny / file), framework="pt") as f:
            if len(list(f.keys())) > 1:  # a tensor larger than a shard has a file of its own
                assert (tiny / file).stat().st_size <= SHARD, file


def test_transformers_loads_what_load_hf_checkpoint_loads(tiny):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.rope_parameters["rope_theta"] == 500000.0
    config, theta = load_hf_checkpoint(tiny)
    assert config == LlamaConfig.from_hf(CONFIGS["tiny"])
    sd = model.state_dict()
    assert set(sd) - set(theta.keys()) == {"lm_head.weight"}  # tied: the embedding
    for name, t in theta.items():
        assert torch.equal(sd[name], t), name
    assert torch.equal(sd["lm_head.weight"], theta.get("model.embed_tokens.weight"))
    # HF-like init: matrices N(0, 0.02), norms near 1
    up = theta.get("model.layers.0.mlp.up_proj.weight").float()
    assert abs(up.std().item() - 0.02) < 0.002 and abs(up.mean().item()) < 0.002
    assert abs(theta.get("model.norm.weight").float().mean().item() - 1.0) < 0.01


def test_same_seed_same_tensors_whatever_the_shard_size(tiny, tmp_path):
    write_checkpoint(tmp_path / "one", "tiny", "bfloat16", seed=0, log=None)
    assert [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    a, b = _tensors(tiny), _tensors(tmp_path / "one")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), name
    write_checkpoint(tmp_path / "other", "tiny", "bfloat16", seed=1, log=None)
    c = _tensors(tmp_path / "other")
    assert all(not torch.equal(a[n], c[n]) for n in a)


def test_a_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="injected"):
        write_checkpoint(tmp_path / "out", "tiny", shard_size=SHARD, log=None)
    assert len(calls) == 2 and Path(calls[0]).parent.parent == tmp_path  # one shard was written, beside OUT
    assert list(tmp_path.iterdir()) == []


def test_an_invalid_config_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**CONFIGS["tiny"], "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="multiple of num_kv_heads=3"):
        write_checkpoint(tmp_path / "out", bad, log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_an_existing_non_empty_out_is_refused_unless_forced(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert make_checkpoint.main(["--config", "tiny", str(out)]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    write_checkpoint(out, "tiny", force=True, log=None)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    write_checkpoint(empty, "tiny", log=None)  # an empty directory is taken
    assert (empty / "model.safetensors").is_file()


def test_cached_checkpoint_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARKTANK_CACHE", str(tmp_path))
    path = cached_checkpoint("tiny", "float32", seed=3)
    assert path == tmp_path / "checkpoints" / "tiny-float32-s3"
    assert _tensors(path)["model.norm.weight"].dtype == torch.float32
    monkeypatch.setattr(make_checkpoint, "write_checkpoint", lambda *a, **k: pytest.fail("written twice"))
    assert cached_checkpoint("tiny", "float32", seed=3) == path


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_per_token_is_the_checkpoint_less_the_embedding_but_one_row(tmp_path, tied):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({**CONFIGS["tiny"], "tie_word_embeddings": tied}))
    write_checkpoint(tmp_path / "ck", config, "float16", shard_size=SHARD, log=None)
    total = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    vocab, hidden = CONFIGS["tiny"]["vocab_size"], CONFIGS["tiny"]["hidden_size"]
    embed = vocab * hidden * 2
    lm_head = embed if tied else 0  # untied, the checkpoint holds it already
    assert weight_bytes_per_token(CONFIGS["tiny"], 2, tied) == total - embed + hidden * 2 + lm_head


def _peak_rss_bytes(args: list[str], tmp_path: Path) -> int:
    time_bin = shutil.which("time", path="/usr/bin")
    if time_bin is None:
        pytest.skip("no /usr/bin/time")
    report = tmp_path / f"rss-{len(list(tmp_path.iterdir()))}.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [time_bin, "-f", "%M", "-o", str(report), sys.executable, str(ROOT / "tools" / "make_checkpoint.py"), *args]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return int(report.read_text().split()[-1]) * 1024


def test_the_writer_holds_one_shard_not_the_checkpoint(tmp_path):
    # 313 MB of bfloat16 in 32 MB shards; the largest tensor (embedding, lm_head) is 65.5 MB.
    d = {**CONFIGS["tiny"], "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6,
         "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": False}
    config = tmp_path / "mid.json"
    config.write_text(json.dumps(d))
    shapes = llama_shapes(LlamaConfig.from_hf(d))
    total = sum(math.prod(s) for s in shapes.values()) * 2
    largest = max(math.prod(s) for s in shapes.values()) * 2
    shard = 32 << 20
    # The interpreter, torch, safetensors and the writer's code, on a tiny write.
    baseline = _peak_rss_bytes(["--config", "tiny", str(tmp_path / "small")], tmp_path)
    peak = _peak_rss_bytes(["--config", str(config), "--shard-size", str(shard), str(tmp_path / "mid")], tmp_path)
    # It holds the current shard (at most shard bytes, or one larger tensor) while writing it;
    # the bound allows a shard and a largest tensor at once, plus 64 MB for what a tiny write
    # does not allocate (torch's thread arenas and first-use buffers; about 45 MB measured here).
    bound = baseline + shard + largest + (64 << 20)
    assert baseline + total > bound  # a writer holding the whole checkpoint would fail
    assert peak < bound, f"peak RSS {peak / 1e6:.0f} MB; baseline {baseline / 1e6:.0f} MB, bound {bound / 1e6:.0f} MB"
    assert len(list((tmp_path / "mid").glob("*.safetensors"))) >= 8  # 2 of 65.5 MB, the rest in 32 MiB


def test_the_checkpoint_carries_a_byte_tokenizer_at_the_configs_special_ids(tiny):
    from sharktank.text.tokenizer import HFTokenizer

    config = json.loads((tiny / "config.json").read_text())
    tok = HFTokenizer.from_checkpoint(tiny)
    assert tok.bos_token_id == config["bos_token_id"] and config["eos_token_id"] in tok.eos_token_ids
    text = "Sharding, café 日本"
    ids = tok.encode(text)
    assert ids[0] == config["bos_token_id"] and len(ids) == 1 + len(text.encode())  # one token per byte
    assert max(ids) < config["vocab_size"] and tok.decode(ids) == text


def test_a_cached_checkpoint_from_before_tokenizers_gets_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARKTANK_CACHE", str(tmp_path))
    path = cached_checkpoint("tiny", "float32", seed=4)
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").unlink()
    monkeypatch.setattr(make_checkpoint, "write_checkpoint", lambda *a, **k: pytest.fail("written twice"))
    assert cached_checkpoint("tiny", "float32", seed=4) == path
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in path.iterdir() if p.is_dir()]  # the temporary directory is gone
