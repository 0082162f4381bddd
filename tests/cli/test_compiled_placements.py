"""Compiled and run on CPU local-task devices, from a transformers checkpoint directory:
tp=2, pp=2 and DualPipeV (8 devices); logits and ids match eager, transfers match the plan."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from sharktank.export.artifact import export_artifact
from sharktank.models import load_model
from sharktank.runtime import CompiledModel

DUALPIPEV = Path(__file__).resolve().parents[2] / "exports" / "placements" / "dualpipev-pp8-dp2.json"


@functools.lru_cache(maxsize=None)
def checkpoint(root: str, layers: int) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    path = Path(root) / f"hf{layers}"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "name, layers, kwargs, batch, transfers",
    [
        # 2 blocks x 2 all_reduces x 2 (two devices swap shards), the LM-head gather (1),
        # tokens and positions from device 0 to device 1 (2).
        ("tp2", 2, dict(tp=2), 1, 2 * 2 * 2 + 1 + 2),
        # One stage boundary, one shard, and the positions for the second stage.
        ("pp2", 2, dict(pp=2), 1, 1 + 1),
        # Two microbatches, each on a V path 0-1-2-3-3-2-1-0 or 4-5-6-7-7-6-5-4 (6 boundaries,
        # 3->3 stays put); inputs arrive on device 0 and go to the 3 (or 4, and the tokens
        # to device 4) other devices of the path.
        ("dualpipev", 8, dict(placement=DUALPIPEV), 2, 2 * 6 + 3 + 5),
    ],
)
def test_compiled_matches_eager(tmp_path_factory, name, layers, kwargs, batch, transfers):
    root = tmp_path_factory.getbasetemp()
    model = load_model(checkpoint(str(root), layers), **kwargs)
    out = tmp_path_factory.mktemp(name) / "art"
    manifest = export_artifact(model, out, source=str(checkpoint(str(root), layers)), batch_sizes=(batch,), max_seq_len=16)
    # Each prefill also sends its kept positions (whose logits it returns) from device 0 to
    # the devices of the head that are not device 0: 1 (tp2, pp2); 4, the second V's end.
    kept = 1
    want_transfers = {f"prefill_bs{batch}": transfers + kept, f"decode_bs{batch}": transfers}
    if batch > 1:  # prefill_row also sends the row index from device 0 to the 7 others
        want_transfers[f"prefill_row_bs{batch}"] = transfers + 7 + kept
        # prefill_rows: the padding mask goes where the positions go (the 7 other devices)
        want_transfers[f"prefill_rows_bs{batch}"] = transfers + 7 + kept
    if name != "dualpipev":  # one microbatch: prefill_chunk, whose row index goes to the other device
        want_transfers[f"prefill_chunk_bs{batch}"] = transfers + 1 + kept
    assert manifest.transfers == want_transfers
    compiled = CompiledModel(out)
    tokens = torch.tensor([[3, 14, 15, 9, 2, 6], [5, 35, 8, 9, 7, 9]])[:batch]

    logits, cache = compiled.prefill(tokens)
    eager_cache = model.new_cache(batch, 16)
    want = model.prefill(tokens, eager_cache)
    assert (logits - want).abs().max().item() <= 1e-4
    nxt = want[:, -1].argmax(-1)
    pos = torch.full((batch,), tokens.shape[1])
    got, _ = compiled.decode(nxt, cache, pos)
    assert (got - model.decode(nxt, eager_cache, pos)).abs().max().item() <= 1e-4

    ids, _ = compiled.generate(tokens, 6)
    assert torch.equal(ids, model.generate(tokens, 6))
    if batch > 1:  # the last row belongs to the last microbatch (its own path)
        got, _ = compiled.prefill_row(tokens[-1:], batch - 1, compiled.new_cache(batch))
        assert (got - model.prefill(tokens[-1:])).abs().max().item() <= 1e-4
