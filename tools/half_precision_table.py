"""How closely float16 and bfloat16 models track the float32 transformers reference.

    python tools/half_precision_table.py [--no-compile] [--prompt 64]

A transformers ``LlamaForCausalLM`` with the ``toy-llama-3l`` shapes (hidden 256, 3 blocks,
8 heads / 4 KV heads of 32, FFN 23, rope base 500000, eps 0.01; transformers' random init)
runs a random prompt in float32: that is the reference. The same weights, converted to each
half type, run through sharktank eagerly for tp in {1, 2} x pp in {1, 2}, and compiled
(IREE llvm-cpu) for tp1 and tp2 x pp2. Per row: the lowest and the mean cosine similarity of
the logits per position, the share of positions whose top-1 token matches the reference's,
and for compiled rows the largest |compiled - eager| in the same dtype.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def reference(prompt: int):
    import transformers

    from sharktank.models.llama import LlamaConfig
    from sharktank.weights import Theta

    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=23, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0, rms_norm_eps=0.01,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(hc).eval()
    theta = Theta({k: v.detach() for k, v in model.state_dict().items() if "rotary" not in k})
    tokens = torch.randint(0, hc.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits[0]
    return LlamaConfig.from_hf(hc.to_dict()), theta, tokens, want


def scores(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    cos = torch.nn.functional.cosine_similarity(got.float(), want, dim=-1)
    top1 = (got.float().argmax(-1) == want.argmax(-1)).float().mean().item()
    return cos.min().item(), cos.mean().item(), top1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=64, help="prompt length (default 64)")
    ap.add_argument("--no-compile", action="store_true", help="eager rows only")
    args = ap.parse_args()

    from sharktank.models.llama.model import LlamaModel
    from sharktank.parallel import ParallelPlan

    config, theta, tokens, want = reference(args.prompt)
    print(f"{'dtype':9} {'tp':>2} {'pp':>2} {'mode':8} {'min cos':>9} {'mean cos':>9} {'top-1':>6} {'|compiled-eager|':>17}")
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        models = {}
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            model = LlamaModel(config, theta.map(lambda _, t: t.to(dtype)), ParallelPlan.from_tp_pp(config.num_layers, tp, pp))
            with torch.no_grad():
                eager = model.prefill(tokens)[0]
            models[tp, pp] = (model, eager)
            lo, mean, top1 = scores(eager, want)
            print(f"{name:9} {tp:>2} {pp:>2} {'eager':8} {lo:9.6f} {mean:9.6f} {top1:6.1%}")
        if args.no_compile:
            continue
        from sharktank.export.artifact import export_artifact
        from sharktank.runtime import CompiledModel

        for tp, pp in ((1, 1), (2, 2)):
            model, eager = models[tp, pp]
            with tempfile.TemporaryDirectory() as d:
                out = Path(d) / "art"
                export_artifact(model, out, source="half_precision_table", max_seq_len=args.prompt)
                got = CompiledModel(out).prefill(tokens)[0][0]
            lo, mean, top1 = scores(got, want)
            diff = (got.float() - eager.float()).abs().max().item()
            print(f"{name:9} {tp:>2} {pp:>2} {'compiled':8} {lo:9.6f} {mean:9.6f} {top1:6.1%} {diff:17.3g}")


if __name__ == "__main__":
    main()
