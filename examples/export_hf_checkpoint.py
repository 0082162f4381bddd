"""Export your own Hugging Face checkpoint tensor-parallel over 2 devices, compile it for the
CPU, and run it against eager torch and against transformers.

    python examples/export_hf_checkpoint.py [CHECKPOINT_DIR] [--out DIR] [--tp 2]

CHECKPOINT_DIR holds ``config.json`` and ``*.safetensors`` as ``save_pretrained`` writes them
(a Llama, Mistral, Qwen2/Qwen3 or Mixtral/Qwen3-MoE layout). Without one, a tiny random-weight
Llama is written first with transformers (nothing is downloaded). The same steps on the command
line: ``sharktank export --model DIR --tp 2 --output-dir OUT`` then ``sharktank run OUT --tokens
... --compare-eager``.

Prints the greedy ids of each side and the largest logit errors; exits 1 if the compiled
module's ids differ from eager's or its logits stray past 1e-4.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def tiny_checkpoint(directory: Path) -> Path:
    """A 2-layer random-weight Llama saved as a Hugging Face checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", type=Path, help="a Hugging Face checkpoint directory (default: a tiny one written here)")
    p.add_argument("--out", type=Path, help="where the artifact goes (default: a temporary directory)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    args = p.parse_args(argv)

    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model
    from sharktank.runtime import CompiledModel

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or tiny_checkpoint(Path(tmp) / "ckpt")
        out = args.out or Path(tmp) / "artifact"
        # deferred: placeholder weights while tracing; the archives are written tensor by tensor.
        # functions: generate needs only prefill and decode (serving would add prefill_row/chunk).
        manifest = export_artifact(load_model(ckpt, tp=args.tp, deferred=True), out, source=str(ckpt), max_seq_len=32,
                                   functions=("prefill", "decode"), progress=lambda msg: print(" ", msg))
        print(f"wrote {out}: {manifest.device_count} devices, transfers per function {manifest.transfers}")

        tokens = torch.tensor([[1, 5, 9, 13, 17, 21]])
        compiled, eager = CompiledModel(out), load_model(ckpt, tp=args.tp)
        ids, steps = compiled.generate(tokens, 8)
        want_ids = eager.generate(tokens, 8)
        want = eager.prefill(torch.cat([tokens, ids[:, :-1]], 1))[:, tokens.shape[1] - 1 :]
        err = float((steps - want).abs().max())
        print("compiled ids:", ids[0].tolist())
        print("eager ids:   ", want_ids[0].tolist())
        print(f"max |compiled - eager| over the 8 steps' logits: {err:.3g}")
        if args.checkpoint is None:  # the reference itself, for the checkpoint written here
            from transformers import LlamaForCausalLM

            with torch.no_grad():
                ref = LlamaForCausalLM.from_pretrained(ckpt).eval()(tokens).logits
            print(f"max |eager - transformers| on the prompt: {float((eager.prefill(tokens) - ref).abs().max()):.3g}")
        return 0 if torch.equal(ids, want_ids) and err <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
