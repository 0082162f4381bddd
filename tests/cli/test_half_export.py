"""Half-precision models compiled: the module computes in that dtype and agrees with eager.

Tolerance: compiled and eager run the same half-precision arithmetic in different orders
(IREE fuses and tiles reductions differently), so they may differ by a few units in the last
place of the largest logits: we allow 8 ulp of the logit range, i.e. 8 * eps(dtype) * max|logit|.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from sharktank.export.artifact import export_artifact
from sharktank.export.compile import compile_flags
from sharktank.models.llama.model import LlamaModel
from sharktank.models.llama.presets import PRESETS, random_theta
from sharktank.runtime import CompiledModel

MLIR_TYPE = {torch.float16: "f16", torch.bfloat16: "bf16"}


def _assert_linear_products_are_half_with_float32_accumulators(mlir: str, half: str, blocks: int) -> None:
    """After the compiler's input conversion, every 2-D product (the linears) reads the weight
    and activation in the half type and accumulates in float32, as torch's CPU kernels do; no
    weight is widened to a float32 copy first. A float16 model's products are the F16
    kernels' instead (export/kernels/f16: the weight read as stored, float32 sums): a decode
    step's always, a prompt's where the CPU has a bfloat16 dot form (the prefill dispatch); a
    bfloat16 model's the BF16 kernels' where the CPU lacks AVX512-BF16 (export/kernels/bf16)."""
    import iree.compiler as ic

    from sharktank.export.kernels import BF16_DOT, isa

    linalg = ic.compile_str(mlir, extra_args=[*compile_flags(1), "--compile-to=input"]).decode()
    products = re.findall(r"linalg\.matmul ins\(.*?: tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) outs\(.*?: tensor<[^>]*x(\w+)>\)", linalg)
    # q, k, v, o, gate, up, down per block and the LM head, in prefill and decode.
    per_function = 7 * blocks + 1
    kernels = {"decode": 0, "prompt": 0}
    if half == "f16" or isa.HOST.bf16_dot != "avx512_bf16":
        kernels["decode"] = len(re.findall(rf"util\.call @sharktank_{half}_product_1x", mlir))
        kernels["prompt"] = len(re.findall(rf"util\.call @sharktank_{half}_prefill_", mlir))
        assert kernels == {"decode": per_function, "prompt": per_function if BF16_DOT else 0}
    assert len(products) + sum(kernels.values()) == 2 * per_function
    assert set(products) <= {(half, half, "f32")}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_compiled_matches_eager(tmp_path, dtype):
    config = dataclasses.replace(PRESETS["toy-llama"], num_layers=2)  # small: two compiles in CI
    model = LlamaModel(config, random_theta(config, dtype=dtype))
    export_artifact(model, tmp_path / "art", source="toy-llama (2 blocks)", max_seq_len=16, functions=("prefill", "decode"))
    mlir = (tmp_path / "art" / "model.mlir").read_text()
    # No silent float32: every weight global and every cache argument is in the model dtype.
    weight_types = re.findall(r"util\.global private @\S+ .*?: tensor<[\dx]+x(\w+)>", mlir)
    assert weight_types and set(weight_types) == {MLIR_TYPE[dtype]}
    sig = re.search(r"func\.func @decode_bs1\((.*?)\) ->", mlir, re.S).group(1)
    assert sig.count(f"],{MLIR_TYPE[dtype]}>") == 2 * model.config.num_layers  # k and v per block
    _assert_linear_products_are_half_with_float32_accumulators(mlir, MLIR_TYPE[dtype], model.config.num_layers)

    compiled = CompiledModel(tmp_path / "art")
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    ids, logits = compiled.generate(tokens, 5)
    assert logits.dtype == dtype
    eager_ids = model.generate(tokens, 5)
    full = torch.cat([tokens, ids[:, :-1]], dim=1)
    want = model.prefill(full)[:, tokens.shape[1] - 1 :]
    tol = 8 * torch.finfo(dtype).eps * want.float().abs().max().item()
    assert (logits.float() - want.float()).abs().max().item() <= tol
    assert torch.equal(ids, eager_ids)
