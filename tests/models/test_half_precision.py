"""float16 and bfloat16 models against the float32 transformers reference."""

from __future__ import annotations

import functools

import pytest
import torch

from sharktank.models import load_model
from sharktank.models.llama import LlamaConfig
from sharktank.models.llama.model import LlamaModel
from sharktank.parallel import ParallelPlan
from sharktank.weights import Theta


@functools.lru_cache(maxsize=None)
def reference():
    import transformers

    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(hc).eval()
    theta = Theta({k: v.detach() for k, v in model.state_dict().items() if "rotary" not in k})
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits[0]
    return LlamaConfig.from_hf(hc.to_dict()), theta, tokens, want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_half_precision_logits_track_float32_reference(dtype, tp, pp):
    config, theta, tokens, want = reference()
    model = LlamaModel(config, theta.map(lambda _, t: t.to(dtype)), ParallelPlan.from_tp_pp(config.num_layers, tp, pp))
    got = model.prefill(tokens)[0]
    assert got.dtype == dtype  # activations really are half precision
    cos = torch.nn.functional.cosine_similarity(got.float(), want, dim=-1)
    assert cos.min().item() >= 0.999
    assert (got.float().argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


def test_dtype_is_validated_and_presets_carry_theirs():
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        load_model("toy-llama", dtype=torch.int8)
    m = load_model("toy-llama-3l")
    c = m.config
    assert m.dtype == torch.float16
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (256, 256, 3, 8, 4, 32)
    assert (c.intermediate_size, c.rope_theta, c.rms_norm_eps, c.max_seq_len) == (23, 500000.0, 0.01, 128)
