"""GGML block layouts against the gguf package's own dequantizer (the oracle, not our code)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from sharktank.types import LAYOUTS, QuantizationError, QuantizedTensor

# Where each layout keeps its float16 scales (random bytes there could be inf or NaN).
_SCALE_OFFSETS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
}


def test_every_layout_has_its_scales_listed_here():
    assert set(_SCALE_OFFSETS) == set(LAYOUTS)


def _random_blocks(name: str, count: int, seed: int) -> np.ndarray:
    """``count`` valid blocks: random bytes, with finite random float16 scales."""
    rng = np.random.default_rng(seed)
    layout = LAYOUTS[name]
    raw = rng.integers(0, 256, size=(count, layout.block_bytes), dtype=np.uint8)
    for off in _SCALE_OFFSETS[name]:
        scales = rng.uniform(-3, 3, count).astype(np.float16)
        raw[:, off : off + 2] = np.frombuffer(scales.tobytes(), np.uint8).reshape(count, 2)
    return raw


def test_layouts_agree_with_gguf_sizes():
    for name, layout in LAYOUTS.items():
        assert (layout.block_size, layout.block_bytes) == gguf.GGML_QUANT_SIZES[GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@given(rows=st.integers(1, 3), blocks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_dequantize_equals_gguf(name, rows, blocks, seed):
    layout = LAYOUTS[name]
    raw = _random_blocks(name, rows * blocks, seed)
    want = gguf.quants.dequantize(raw.reshape(rows, blocks * layout.block_bytes), GGMLQuantizationType[name])
    t = QuantizedTensor(name, (rows, blocks * layout.block_size), torch.from_numpy(raw.copy()))
    got = t.dequantize()
    assert got.shape == (rows, blocks * layout.block_size) and got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))


def test_blocks_of_the_real_model_dequantize_as_gguf_does(smollm2_gguf):
    # Blocks written by llama.cpp's quantizer (Q4_1 and the Q8_0 embedding), not random bytes.
    reader = gguf.GGUFReader(str(smollm2_gguf))
    seen = set()
    for rt in reader.tensors:
        kind = rt.tensor_type.name
        if kind not in LAYOUTS or kind in seen:
            continue
        seen.add(kind)
        rows = np.asarray(rt.data)[:64]  # [rows, bytes per row]
        shape = (rows.shape[0], int(rt.shape[0]))
        want = gguf.quants.dequantize(rows, rt.tensor_type)
        got = QuantizedTensor(kind, shape, torch.from_numpy(rows.copy()), name=rt.name).dequantize()
        assert torch.equal(got, torch.from_numpy(want.astype(np.float32))), rt.name
    assert seen == {"Q4_1", "Q8_0"}


def test_q8_0_of_real_weights_roundtrips_within_its_step():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    raw = gguf.quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    t = QuantizedTensor("Q8_0", w.shape, torch.from_numpy(raw.copy()), name="w")
    # Each block of 32 is scaled to int8 (an error of at most half a step, max|block| / 254)
    # by a float16 scale (relative rounding 2**-11, times |q| <= 127 steps: max|block| / 2**11).
    amax = w.reshape(8, 2, 32).abs().amax(-1, keepdim=True)
    err = (t.dequantize() - w).reshape(8, 2, 32).abs()
    assert bool((err <= amax / 254 + amax / 2**11).all())
    assert err.max() > 0  # it is quantized
    assert t.dequantize(torch.float16).dtype == torch.float16 and t.nbytes == 8 * 2 * 34


def test_bad_blocks_are_refused_naming_the_tensor():
    ok = torch.zeros(2 * 34, dtype=torch.uint8)
    with pytest.raises(QuantizationError, match=r"blk\.0\.attn_q\.weight: quantization 'IQ2_XXS' is not supported; supported: Q8_0, Q4_0, Q4_1, .*IQ4_XS"):
        QuantizedTensor("IQ2_XXS", (1, 256), ok, name="blk.0.attn_q.weight")
    with pytest.raises(QuantizationError, match=r"w: shape \[1, 48\]: the last dim must be a multiple of Q8_0's block size 32"):
        QuantizedTensor("Q8_0", (1, 48), ok, name="w")
    with pytest.raises(QuantizationError, match=r"w: Q8_0 \[1, 64\] needs 68 bytes .* found 67"):
        QuantizedTensor("Q8_0", (1, 64), ok[:-1], name="w")
    with pytest.raises(QuantizationError, match="uint8 tensor, found torch.int8"):
        QuantizedTensor("Q8_0", (1, 64), ok.view(torch.int8), name="w")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_ops_with_a_quantized_weight_equal_dequantize_then_op(name):
    from sharktank import ops

    layout = LAYOUTS[name]
    out_features, in_features = 6, 2 * layout.block_size
    w = QuantizedTensor(name, (out_features, in_features), torch.from_numpy(_random_blocks(name, out_features * 2, 7)), name="w")
    dense = w.dequantize()
    x = torch.randn(3, 4, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features)
    assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, dense))
    assert torch.equal(ops.linear(x, w, bias), torch.nn.functional.linear(x, dense, bias))
    assert torch.equal(ops.matmul(x, w, transpose_rhs=True), x @ dense.mT)
    ids = torch.tensor([[0, 5, 2], [5, 5, 1]])
    assert torch.equal(ops.embedding_lookup(ids, w), torch.nn.functional.embedding(ids, dense))
    assert ops.embedding_lookup(ids, w, torch.float16).dtype == torch.float16


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 summation order: random blocks make values of 1e5 and more."""
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-5 * want.abs().max())


def _quantized_weight(name: str, rows: int, blocks_per_row: int, seed: int = 7) -> QuantizedTensor:
    raw = torch.from_numpy(_random_blocks(name, rows * blocks_per_row, seed))
    return QuantizedTensor(name, (rows, blocks_per_row * LAYOUTS[name].block_size), raw, name="w")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_quantized_linear_equals_the_dequantized_one(name):
    # Column-parallel (rows split, any count), row-parallel (input split at whole blocks,
    # then all_reduce), replicated; pinned weights keep the placement rule's behaviour.
    from sharktank import ops
    from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor

    w = _quantized_weight(name, 6, 4)
    dense = w.dequantize()
    x = torch.randn(2, 3, w.shape[1], generator=torch.Generator().manual_seed(2))
    want = torch.nn.functional.linear(x, dense)
    for n in (2, 3):
        col = SplitPrimitiveTensor(shard_dim=0, ts=w, shard_count=n, pinned=True)
        assert isinstance(col.shards[0], QuantizedTensor) and col.shard_sizes == [6 // n] * n
        assert _close(ops.unshard(ops.linear(x, col)), want)
    row = SplitPrimitiveTensor(shard_dim=1, ts=w, shard_count=2, devices=(3, 5), pinned=True)
    xs = SplitPrimitiveTensor(shard_dim=2, ts=x, devices=(3, 5))
    out = ops.linear(xs, row)
    assert type(out).__name__ == "UnreducedTensor" and out.devices == (3, 5) and out.pinned is False
    assert _close(ops.unshard(ops.all_reduce(out)), want)
    rep = ReplicatedTensor(ts=w, shard_count=2, pinned=True)
    assert _close(ops.unshard(ops.linear(x, rep)), want)
    assert ops.unshard(col).equal(w) and ops.unshard(row).equal(w)
    # An unpinned activation on other devices moves to the pinned quantized weight.
    moved = ops.linear(ReplicatedTensor(ts=x, devices=(0, 1)), SplitPrimitiveTensor(shard_dim=0, ts=w, devices=(3, 5), pinned=True))
    assert moved.devices == (3, 5)


def test_a_split_that_cuts_a_block_is_refused_with_the_block_size():
    from sharktank.types import SplitPrimitiveTensor

    w = _quantized_weight("Q4_K", 4, 2)  # 512 inputs: 2 blocks of 256
    with pytest.raises(QuantizationError, match="blocks hold 256 values each"):
        SplitPrimitiveTensor(shard_dim=1, ts=w, shard_count=4)


def test_sharded_quantized_embedding_lookup_equals_the_dequantized_one():
    from sharktank import ops
    from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor

    table = _quantized_weight("Q8_0", 10, 2)
    dense = table.dequantize()
    ids = torch.tensor([[0, 9, 4], [7, 7, 1]])
    want = torch.nn.functional.embedding(ids, dense)
    for t in (ReplicatedTensor(ts=table, shard_count=2), SplitPrimitiveTensor(shard_dim=0, ts=table, shard_count=3),
              SplitPrimitiveTensor(shard_dim=1, ts=table, shard_count=2)):
        # A vocabulary split gives partial results (zeros outside each shard's rows): unshard sums them.
        assert torch.equal(ops.unshard(ops.embedding_lookup(ids, t)), want), t


def test_sharded_quantized_weights_keep_their_placement_through_save_theta(tmp_path):
    from sharktank.models.llama.presets import PRESETS
    from sharktank.types import ReplicatedTensor, SplitPrimitiveTensor, is_deep_equal
    from sharktank.models import load_theta, save_theta
    from sharktank.weights import Theta

    w = _quantized_weight("Q4_K", 4, 2)
    theta = Theta({
        "plain": w,
        "rows": SplitPrimitiveTensor(shard_dim=0, ts=w, devices=(2, 5), pinned=True, name="rows"),
        "blocks": SplitPrimitiveTensor(shard_dim=1, ts=w, devices=(1, 0), pinned=False),
        "replicated": ReplicatedTensor(ts=_quantized_weight("Q8_0", 3, 1), devices=(0, 1, 2), pinned=True),
    })
    save_theta(tmp_path / "theta", PRESETS["toy-llama"], theta)
    _, back = load_theta(tmp_path / "theta")
    for name in theta:
        assert is_deep_equal(back[name], theta[name]), name
    assert back["rows"].devices == (2, 5) and back["rows"].pinned and back["blocks"].shard_dim == 1
