"""GGUF save/load: exact round trips, llama.cpp's q/k layout, damaged files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from sharktank.models.llama.config import LlamaConfig
from sharktank.types import ReplicatedTensor
from sharktank.models import load_gguf, load_hf_checkpoint, save_gguf
from sharktank.models.llama.layout import llama_shapes
from sharktank.weights import Theta, WeightsError

SMALL = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64
)


def random_theta(config: LlamaConfig, seed: int = 0) -> Theta:
    gen = torch.Generator().manual_seed(seed)
    return Theta({name: torch.randn(shape, generator=gen) for name, shape in llama_shapes(config).items()})


@pytest.fixture(scope="module")
def hf_theta(hf_checkpoint):
    return load_hf_checkpoint(hf_checkpoint)


def _interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order, by index: head h's row j is HF row j//2 (+ head_dim/2 if j odd)."""
    hd = w.shape[0] // heads
    return w[[h * hd + j // 2 + (j % 2) * (hd // 2) for h in range(heads) for j in range(hd)]]


def _assert_same(a: Theta, b: Theta):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_of_the_transformers_model(hf_theta, tmp_path, dtype):
    config, theta = hf_theta
    theta = theta.map(lambda _, t: t.to(dtype))
    save_gguf(tmp_path / "m.gguf", config, theta)
    config2, theta2 = load_gguf(tmp_path / "m.gguf")
    assert config2 == config
    _assert_same(theta2, theta)


def test_file_uses_llama_cpp_names_keys_and_dim_order(hf_theta, tmp_path):
    config, theta = hf_theta
    save_gguf(tmp_path / "m.gguf", config, theta)
    reader = GGUFReader(tmp_path / "m.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.context_length"] == 64 and fields["llama.embedding_length"] == 32
    assert fields["llama.block_count"] == 2 and fields["llama.feed_forward_length"] == 48
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 8 and fields["llama.rope.freq_base"] == 10000.0
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config.rms_norm_eps)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 21 and "blk.1.ffn_down.weight" in tensors and "output_norm.weight" in tensors
    # ggml lists dims fastest-first: the embedding is ne = [hidden, vocab].
    assert tensors["token_embd.weight"].shape.tolist() == [32, 64]
    assert tensors["blk.0.ffn_down.weight"].shape.tolist() == [48, 32]


def test_q_and_k_are_stored_interleaved(hf_theta, tmp_path):
    config, theta = hf_theta
    save_gguf(tmp_path / "m.gguf", config, theta)
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(tmp_path / "m.gguf").tensors}
    for layer in range(2):
        p, b = f"model.layers.{layer}.self_attn.", f"blk.{layer}."
        q, k, v = theta[p + "q_proj.weight"], theta[p + "k_proj.weight"], theta[p + "v_proj.weight"]
        assert not torch.equal(raw[b + "attn_q.weight"], q) and not torch.equal(raw[b + "attn_k.weight"], k)
        assert torch.equal(raw[b + "attn_q.weight"], _interleaved(q, 4))
        assert torch.equal(raw[b + "attn_k.weight"], _interleaved(k, 2))
        assert torch.equal(raw[b + "attn_v.weight"], v)


def test_transformers_reads_our_file_as_the_original_model(tmp_path):
    # transformers' GGUF reader undoes llama.cpp's q/k row order with its own code, so this
    # checks the layout against an independent implementation: a writer and loader that are
    # wrong the same way still round-trip. q/k biases are permuted like the weights.
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, attention_bias=True,
    ))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at zero
                p.normal_()
    want = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    save_gguf(tmp_path / "m.gguf", LlamaConfig.from_hf(hf.config.to_dict()), Theta(want))
    read = load_gguf_checkpoint(str(tmp_path / "m.gguf"), return_tensors=True, model_to_load=hf)
    c = read["config"]
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope_theta"]) == (4, 2, 8, 500000.0)
    got = read["tensors"]
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(torch.as_tensor(got[name]), want[name]), name


def test_bias_tied_embeddings_head_dim_and_llama3_scaling(tmp_path):
    config = LlamaConfig(
        vocab_size=40, hidden_size=24, intermediate_size=20, num_layers=3, num_heads=2, num_kv_heads=1,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0, max_seq_len=128, attention_bias=True,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )
    theta = random_theta(config)
    save_gguf(tmp_path / "m.gguf", config, theta)
    config2, theta2 = load_gguf(tmp_path / "m.gguf")
    assert config2 == config and "lm_head.weight" not in theta2
    _assert_same(theta2, theta)
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert torch.equal(raw["blk.2.attn_q.bias"], _interleaved(theta["model.layers.2.self_attn.q_proj.bias"], 2))
    assert torch.equal(raw["blk.2.attn_v.bias"], theta["model.layers.2.self_attn.v_proj.bias"])


def test_save_refuses_a_theta_that_disagrees_with_the_config(tmp_path):
    theta = dict(random_theta(SMALL))
    theta["model.norm.weight"] = torch.ones(31)
    with pytest.raises(WeightsError, match=r"bad.gguf.*model.norm.weight.*\[31\]"):
        save_gguf(tmp_path / "bad.gguf", SMALL, Theta(theta))
    theta["model.norm.weight"] = ReplicatedTensor(ts=torch.ones(32), shard_count=2)
    with pytest.raises(WeightsError, match="bad.gguf.*ReplicatedTensor"):
        save_gguf(tmp_path / "bad.gguf", SMALL, Theta(theta))
    theta["model.norm.weight"] = torch.ones(32, dtype=torch.float64)
    with pytest.raises(WeightsError, match="float64"):
        save_gguf(tmp_path / "bad.gguf", SMALL, Theta(theta))
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary files


# --- damaged files ------------------------------------------------------------------------


@pytest.fixture
def good_file(tmp_path):
    save_gguf(tmp_path / "m.gguf", SMALL, random_theta(SMALL))
    return tmp_path / "m.gguf"


@pytest.mark.parametrize("damage", ["truncated", "truncated_in_header", "zero_length", "wrong_magic", "missing"])
def test_damaged_file(good_file, damage):
    data = good_file.read_bytes()
    if damage == "missing":
        good_file.unlink()
    else:
        good_file.write_bytes({
            "truncated": data[: len(data) - 1000],
            "truncated_in_header": data[:200],
            "zero_length": b"",
            "wrong_magic": b"GGUX" + data[4:],
        }[damage])
    with pytest.raises(WeightsError) as err:
        load_gguf(good_file)
    assert err.value.path == str(good_file) and "m.gguf" in str(err.value)


def _write_raw(path, keys: dict, tensors: dict, arch: str = "llama"):
    writer = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_uint32(key, value) if isinstance(value, int) else writer.add_float32(key, value)
    for name, (array, kind) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _raw_model(source):
    """Metadata and tensors of ``source`` for rewriting with :func:`_write_raw`."""
    keys = {
        "llama.context_length": 64, "llama.embedding_length": 32, "llama.block_count": 2,
        "llama.feed_forward_length": 48, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    reader = GGUFReader(source)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    return keys, tensors


def test_raw_writer_baseline_loads(good_file, tmp_path):
    keys, tensors = _raw_model(good_file)
    _write_raw(tmp_path / "raw.gguf", keys, tensors)
    config, theta = load_gguf(tmp_path / "raw.gguf")
    assert config.num_layers == 2 and len(theta) == 21


@pytest.mark.parametrize("damage", ["missing_key", "wrong_shape", "missing_tensor", "unknown_tensor", "quantized", "arch"])
def test_inconsistent_file(good_file, tmp_path, damage):
    keys, tensors = _raw_model(good_file)
    arch, expect = "llama", []
    if damage == "missing_key":
        del keys["llama.block_count"]
        expect = ["llama.block_count"]
    elif damage == "wrong_shape":
        tensors["blk.1.ffn_down.weight"] = (np.zeros((32, 40), np.float32), GGMLQuantizationType.F32)
        expect = ["blk.1.ffn_down.weight", "[32, 40]", "[32, 48]"]
    elif damage == "missing_tensor":
        del tensors["blk.0.attn_norm.weight"]
        expect = ["blk.0.attn_norm.weight", "missing"]
    elif damage == "unknown_tensor":
        tensors["blk.0.attn_qkv.weight"] = (np.zeros((64, 32), np.float32), GGMLQuantizationType.F32)
        expect = ["blk.0.attn_qkv.weight"]
    elif damage == "quantized":
        w = tensors["blk.0.ffn_up.weight"][0]
        # A quantization with no layout here (MXFP4: 32 values in 17 bytes; zero blocks are valid).
        blocks = np.zeros((w.shape[0], w.shape[1] // 32 * 17), np.uint8)
        tensors["blk.0.ffn_up.weight"] = (blocks, GGMLQuantizationType.MXFP4)
        expect = ["blk.0.ffn_up.weight", "MXFP4 is not supported", "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS"]
    else:
        arch, expect = "gemma", ["'gemma'", "expected one of 'llama', 'qwen2', 'qwen3'"]
    _write_raw(tmp_path / "raw.gguf", keys, tensors, arch)
    with pytest.raises(WeightsError) as err:
        load_gguf(tmp_path / "raw.gguf")
    for fragment in ["raw.gguf", *expect]:
        assert fragment in str(err.value), (fragment, str(err.value))
