"""How closely quantized models track the unquantized one.

    python tools/quantized_table.py [--prompt 64] [--no-compile]

A transformers ``LlamaForCausalLM`` (hidden 512, 3 blocks, 8 heads / 4 KV heads of 64, FFN
1024, vocab 512; transformers' random init, float32) runs a random prompt: that is the
reference. ``sharktank quantize``'s path (``quantize_gguf``: the gguf package's own
quantizers) writes its weights as Q8_0 and as Q4_0; each file is loaded with its blocks and
run eagerly at tp 1 and 2 (and compiled at tp 2 unless ``--no-compile``). Per row: the
lowest and the mean cosine similarity of the logits per position, the share of positions
whose top-1 token matches the reference's, and the bytes of the weights. K-quants (Q4_K,
Q6_K) load and run, but gguf has no quantizer for them, so they have no row here: their
blocks must come from files made elsewhere.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def reference(prompt: int):
    import transformers

    from sharktank.models.llama import LlamaConfig
    from sharktank.weights import Theta, WeightSource

    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0, max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(hc).eval()
    theta = Theta({k: v.detach() for k, v in model.state_dict().items() if "rotary" not in k})
    tokens = torch.randint(0, hc.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits[0]
    config = LlamaConfig.from_hf(hc.to_dict())
    return config, WeightSource.of(theta), tokens, want


def row(name: str, got: torch.Tensor, want: torch.Tensor, nbytes: int) -> None:
    cos = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{name:<22} {cos.min().item():>10.5f} {cos.mean().item():>10.5f} {top1:>8.3f} {nbytes / 1e6:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    args = parser.parse_args(argv)

    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model
    from sharktank.runtime import CompiledModel
    from sharktank.models import quantize_gguf

    config, source, tokens, want = reference(args.prompt)
    print(f"{'model':<22} {'min cos':>10} {'mean cos':>10} {'top-1':>8} {'weight MB':>10}")
    row("float32 (reference)", want, want, source.theta.nbytes())
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("q8_0", "q4_0"):
            path = Path(tmp) / f"{kind}.gguf"
            quantize_gguf(path, config, source, to=kind)
            for tp in (1, 2):
                model = load_model(path, tp=tp)
                row(f"{kind} eager tp{tp}", model.prefill(tokens)[0], want, model.source.theta.nbytes())
            if not args.no_compile:
                out = Path(tmp) / f"{kind}-art"
                export_artifact(load_model(path, tp=2, deferred=True), out, source=str(path), max_seq_len=args.prompt)
                got, _ = CompiledModel(out).prefill(tokens)
                row(f"{kind} compiled tp2", got[0], want, model.source.theta.nbytes())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
