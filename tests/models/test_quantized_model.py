"""A GGUF model with quantized weights (Q8_0 from gguf's quantizer; a Q4_K/Q6_K mix as in
Q4_K_M files) runs with its blocks as stored. The oracle is the gguf package's own
dequantizer: the same model with every weight dequantized by ``gguf.quants.dequantize`` to
float32, run eagerly, at every tp x pp placement."""

from __future__ import annotations

import pytest
import torch

from quantized_models import CONFIG, TOKENS, gguf_dequantized, quantized_theta
from sharktank.models import load_model
from sharktank.models.llama.model import LlamaModel
from sharktank.parallel import ParallelPlan
from sharktank.types import QuantizedTensor
from sharktank.models import save_gguf

@pytest.fixture(scope="module", params=["q8_0", "q4_k_m"])
def quantized_file(request, tmp_path_factory):
    """The file, and the gguf-dequantized reference's logits and greedy ids."""
    path = tmp_path_factory.mktemp("quantized") / f"{request.param}.gguf"
    save_gguf(path, CONFIG, quantized_theta(request.param))
    loaded = load_model(path).source.theta  # as read back, q/k rows in the model's order
    reference = LlamaModel(CONFIG, gguf_dequantized(loaded), ParallelPlan.from_tp_pp(CONFIG.num_layers, 1, 1))
    return path, reference.prefill(TOKENS), reference.generate(TOKENS[:1], 4)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_quantized_logits_equal_the_gguf_dequantized_model(quantized_file, tp, pp):
    path, want, want_ids = quantized_file
    model = load_model(path, tp=tp, pp=pp)
    loaded = model.source.theta
    kinds = {t.layout.name for t in loaded.values() if isinstance(t, QuantizedTensor)}
    assert kinds == ({"Q8_0"} if "q8_0" in path.name else {"Q4_K", "Q6_K"})
    # Kept as blocks: the loaded weights take the file's bytes, not float32 copies.
    dense_bytes = sum(t.numel() * 4 for t in loaded.values() if isinstance(t, QuantizedTensor))
    assert loaded.nbytes() < 0.6 * dense_bytes
    got = model.prefill(TOKENS)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-4, f"max |error| / max |logit| = {err:.3g}"
    assert torch.equal(model.generate(TOKENS[:1], 4), want_ids)


def test_quantize_command_writes_q8_0_that_equals_gguf_quantized_weights(tmp_path):
    # An HF checkpoint -> `sharktank quantize --to q8_0`: each 2-D weight holds exactly the
    # blocks gguf.quants.quantize makes of it; the result loads and runs like them.
    import json
    import subprocess
    import sys

    import gguf
    from gguf import GGMLQuantizationType
    from reference import hf_llama

    ref, config, theta = hf_llama(num_layers=2)
    ckpt = tmp_path / "hf"
    ref.save_pretrained(ckpt)
    out = tmp_path / "m.gguf"
    p = subprocess.run([sys.executable, "-m", "sharktank.cli", "quantize", "--to", "q8_0", str(ckpt), str(out), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout)
    assert summary["tensors_by_type"]["Q8_0"] == 1 + 2 * 7 + 1  # embedding, 7 per block, LM head
    loaded = load_model(out).source.theta
    for name, t in theta.items():
        got = loaded[name]
        if t.ndim == 2:
            want = gguf.quants.quantize(t.float().numpy(), GGMLQuantizationType.Q8_0)
            assert isinstance(got, QuantizedTensor) and torch.equal(got.blocks.reshape(t.shape[0], -1), torch.from_numpy(want)), name
        else:
            assert torch.equal(got, t.float()), name
    again = subprocess.run([sys.executable, "-m", "sharktank.cli", "quantize", "--to", "q8_0", str(ckpt), str(out)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists (--force replaces it)" in again.stderr
