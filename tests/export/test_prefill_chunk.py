"""prefill_chunk: a prompt prefilled in chunks into one row of a batch cache, compiled, equals
the eager prefill of the whole prompt, and leaves the other rows as they were."""

from __future__ import annotations

import pytest
import torch

from sharktank.export.artifact import export_artifact
from sharktank.models import load_model
from sharktank.runtime import CompiledModel, InputError

PROMPT = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 31]
OTHERS = {0: [5, 1, 17, 40, 2], 2: [60, 2, 8, 8, 19, 4, 4]}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    root = tmp_path_factory.mktemp("chunk")
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    model = load_model(root / "hf", tp=2)
    manifest = export_artifact(model, root / "art", source=str(root / "hf"), batch_sizes=(1, 3), max_seq_len=32,
                               functions=("prefill", "decode", "prefill_rows", "prefill_chunk"))  # what the tests call
    return model, manifest, CompiledModel(root / "art")


def test_chunks_equal_the_whole_prompt_and_leave_other_rows(artifact):
    model, manifest, compiled = artifact
    # tokens, positions, the row index and the kept positions go from device 0 to device 1
    # (4), and per block the two all_reduces of two devices (2 x 2 x 2) and the LM-head gather (1).
    assert manifest.transfers["prefill_chunk_bs3"] == 4 + 2 * 2 * 2 + 1
    cache = compiled.new_cache(3)
    _, cache = compiled.prefill_rows(list(OTHERS.values()), list(OTHERS), cache)
    logits = []
    for start, end in ((0, 5), (5, 6), (6, 13)):  # the middle chunk is one token
        out, cache = compiled.prefill_chunk(PROMPT, start, end, 1, cache)
        assert out.shape == (end - start, 64)
        logits.append(out)
    eager_cache = model.new_cache(1, 32)
    want = model.prefill(torch.tensor([PROMPT]), eager_cache)[0]
    assert (torch.cat(logits) - want).abs().max().item() <= 1e-4

    # One decode step of all three rows: row 1 continues its prompt; rows 0 and 2 theirs.
    nxt = {r: int(torch.tensor(p).remainder(7)[-1]) for r, p in OTHERS.items()}
    nxt[1] = int(want[-1].argmax())
    positions = torch.tensor([len(OTHERS[0]), len(PROMPT), len(OTHERS[2])])
    got, _ = compiled.decode(torch.tensor([nxt[0], nxt[1], nxt[2]]), cache, positions)
    assert (got[1, 0] - model.decode(torch.tensor([nxt[1]]), eager_cache, torch.tensor([len(PROMPT)]))[0, 0]).abs().max().item() <= 1e-4
    for r, p in OTHERS.items():
        c = model.new_cache(1, 32)
        model.prefill(torch.tensor([p]), c)
        assert (got[r, 0] - model.decode(torch.tensor([nxt[r]]), c, torch.tensor([len(p)]))[0, 0]).abs().max().item() <= 1e-4


def test_a_prompt_continuing_a_rows_prefix_and_a_one_token_prompt(artifact):
    model, _, compiled = artifact
    cache = compiled.new_cache(1)
    _, cache = compiled.prefill(torch.tensor([PROMPT[:8]]), cache)  # the row holds a prefix
    out, cache = compiled.prefill_chunk(PROMPT, 8, len(PROMPT), 0, cache)  # only the rest
    want = model.prefill(torch.tensor([PROMPT]))[0]
    assert (out - want[8:]).abs().max().item() <= 1e-4
    out, _ = compiled.prefill_chunk([PROMPT[0]], 0, 1, 0, compiled.new_cache(1))
    assert (out - model.prefill(torch.tensor([PROMPT[:1]]))[0]).abs().max().item() <= 1e-4


def test_last_logits_are_each_prompts_last_position(artifact):
    """``logits="last"``: each prefill kind returns its prompt's (or chunk's) last position's
    logits only, through the exported ``keep`` index (the final norm and LM head run for
    those positions alone: the function's result has one position), equal to that position
    of ``logits="all"`` and of eager."""
    model, manifest, compiled = artifact
    assert [a.name for a in manifest.functions["prefill_bs3"].inputs] == ["tokens", "positions", "keep"]
    assert [a.name for a in manifest.functions["prefill_chunk_bs3"].inputs] == ["tokens", "positions", "row", "span", "keep"]
    tokens = torch.tensor([PROMPT])
    every, _ = compiled.prefill(tokens)
    last, _ = compiled.prefill(tokens, logits="last")
    assert every.shape == (1, len(PROMPT), 64) and last.shape == (1, 1, 64)
    assert (last[:, 0] - every[:, -1]).abs().max().item() <= 1e-5
    assert (last[0, 0] - model.prefill(tokens)[0, -1]).abs().max().item() <= 1e-4

    prompts = [OTHERS[2], PROMPT, OTHERS[0]]  # three lengths: each row's own last position
    got, cache = compiled.prefill_rows(prompts, [0, 1, 2], compiled.new_cache(3), logits="last")
    for p, out in zip(prompts, got):
        assert out.shape == (1, 64)
        assert (out[0] - model.prefill(torch.tensor([p]))[0, -1]).abs().max().item() <= 1e-4
    # A chunk's last position, and a one-token chunk's (run as two tokens ending at it).
    for start, end in ((5, 13), (12, 13)):
        out, _ = compiled.prefill_chunk(PROMPT, start, end, 1, cache, logits="last")
        assert out.shape == (1, 64) and (out[0] - every[0, -1]).abs().max().item() <= 1e-4
    with pytest.raises(InputError, match=r"logits must be one of \('all', 'last'\), found 'first'"):
        compiled.prefill(tokens, logits="first")


@pytest.mark.parametrize(
    "args, message",
    [
        ((PROMPT, 4, 4, 0), "0 <= start < end <= 13"),
        ((PROMPT, 0, 14, 0), "0 <= start < end <= 13"),
        ((PROMPT, 0, 4, 3), r"row must be an integer in \[0, 3\)"),
        (([1, "2"], 0, 2, 0), "integer token ids"),
        ((list(range(40)), 30, 33, 0), "past the exported cache length 32"),
    ],
)
def test_bad_chunks_are_refused(artifact, args, message):
    _, _, compiled = artifact
    with pytest.raises(InputError, match=message):
        compiled.prefill_chunk(*args, compiled.new_cache(3))


def test_eager_rows_write_only_their_row():
    model = load_model("toy-llama")
    prompt = torch.tensor([PROMPT])
    cache = model.new_cache(3, 32)
    with torch.no_grad():
        got = torch.cat([model.forward(prompt[:, a:b], torch.arange(a, b)[None], cache, window=b, rows=torch.tensor([2])) for a, b in ((0, 4), (4, 13))], 1)
        want = model.prefill(prompt)
    assert (got - want).abs().max().item() <= 1e-5
    k = cache.entries[0][0][0].shards[0]
    assert k[:2].abs().sum() == 0 and k[2, : len(PROMPT)].abs().sum() > 0 and k[2, len(PROMPT) :].abs().sum() == 0
    with pytest.raises(ValueError, match=r"rows must be \[B\] = \[1\] cache rows in \[0, 3\)"):
        model.forward(prompt[:, :2], torch.arange(2)[None], cache, window=2, rows=torch.tensor([3]))


def test_a_long_prompt_is_prefilled_in_chunks_equal_to_the_whole_prompt(artifact, monkeypatch):
    """A batch-1 prefill longer than ``prefill_chunk_tokens`` runs as prefill_chunk_bs1 calls
    (counted) whose logits, all or the last, and cache equal the one whole-prompt call's."""
    _, _, compiled = artifact
    tokens = torch.tensor([PROMPT * 2])  # 26 tokens
    whole, whole_cache = compiled.prefill(tokens)  # 26 <= PREFILL_CHUNK: one call
    whole_last, _ = compiled.prefill(tokens, logits="last")
    calls = []
    real = compiled.prefill_chunk
    monkeypatch.setattr(compiled, "prefill_chunk", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    monkeypatch.setattr(compiled, "prefill_chunk_tokens", 8)
    got, cache = compiled.prefill(tokens)
    assert calls == [(0, 8), (8, 16), (16, 24), (24, 26)]
    assert got.shape == whole.shape == (1, 26, 64) and (got - whole).abs().max().item() <= 1e-5
    last, _ = compiled.prefill(tokens, logits="last")
    assert last.shape == (1, 1, 64) and (last - whole_last).abs().max().item() <= 1e-5
    nxt = torch.tensor([int(whole[0, -1].argmax())])
    a, _ = compiled.decode(nxt, cache, torch.tensor([26]))
    b, _ = compiled.decode(nxt, whole_cache, torch.tensor([26]))
    assert (a - b).abs().max().item() <= 1e-5
    with pytest.raises(InputError, match="logits must be one of"):
        compiled.prefill(tokens, logits="first")
