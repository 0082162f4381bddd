"""`sharktank perplexity`: llama.cpp's method (chunks of W, BOS first, second half scored),
checked against the same computation written here on transformers' logits, on an eager
checkpoint and on its tp2 compiled artifact; and the errors a user gets."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from sharktank.cli import main
from sharktank.evaluate import PerplexityError, perplexity
from tiny import SENTENCES, reference, write_tiny_checkpoint

WINDOW = 32
TEXT = " ".join(SENTENCES * 3)  # ~330 tokens of the tiny BPE: 10 chunks of 32
# Measured: eager vs transformers (float32 log-softmax here, float64 there) 3e-8 relative on the
# running perplexities, the tp2 compiled module (IREE's own matmul and softmax order, two devices
# summing partial products) vs eager 3e-8; the tolerances leave room for other CPUs.
EAGER_RTOL, COMPILED_RTOL = 1e-6, 1e-5


def sharktank(capsys, *args, check=True):
    """The command line in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    if check and rc != 0:
        raise AssertionError(f"sharktank {' '.join(map(str, args))} failed ({rc}):\n{err[-3000:]}")
    return rc, out, err


def test_uniform_logits_give_the_vocabulary_size_and_each_chunk_starts_with_bos():
    seen = []

    def uniform(ids):
        seen.append(ids.tolist())
        return torch.zeros(len(ids), 50)

    ids = list(range(10, 10 + 3 * 8 + 5))  # three chunks of 8, five ids left over; log-softmax in float32 (as llama.cpp)
    r = perplexity(uniform, ids, 8, bos_id=1)
    assert r.chunks == 3 and r.tokens_scored == 3 * (8 - 1 - 4) and math.isclose(r.ppl, 50, rel_tol=1e-6) and len(r.running) == 3
    assert seen == [[1, *ids[c * 8 + 1 : (c + 1) * 8]] for c in range(3)]
    with pytest.raises(PerplexityError, match=r"logits of shape \[7, 50\], expected \[8, vocab\]"):
        perplexity(lambda ids: torch.zeros(7, 50), ids, 8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", layers=2, heads=4, kv_heads=2)
    (d.parent / "text.txt").write_text(TEXT)
    return d


def expected(checkpoint) -> dict:
    """llama.cpp's perplexity written out on transformers' model and tokenizer (float64 scoring)."""
    from transformers import LlamaForCausalLM

    tok = reference()
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id == 0  # this tokenizer adds BOS
    model = LlamaForCausalLM.from_pretrained(checkpoint).eval()
    nll, count, running = 0.0, 0, []
    for c in range(len(ids) // WINDOW):
        chunk = torch.tensor([tok.bos_token_id] + ids[c * WINDOW + 1 : (c + 1) * WINDOW])
        with torch.no_grad():
            logits = model(chunk[None]).logits[0].double()
        for j in range(WINDOW // 2, WINDOW - 1):
            nll -= float(torch.log_softmax(logits[j], -1)[chunk[j + 1]])
            count += 1
        running.append(math.exp(nll / count))
    return {"ppl": math.exp(nll / count), "tokens_scored": count, "chunks": len(ids) // WINDOW, "running_ppl": running, "tokens": len(ids)}


def test_eager_checkpoint_matches_transformers(checkpoint, capsys):
    want = expected(checkpoint)
    assert want["chunks"] >= 3
    got = json.loads(sharktank(capsys, "perplexity", checkpoint, "--text", checkpoint.parent / "text.txt", "--window", WINDOW, "--json")[1])
    assert got["kind"] == "eager" and got["window"] == WINDOW and got["bos_id"] == 0
    for key in ("tokens_scored", "chunks", "tokens"):
        assert got[key] == want[key], key
    assert got["ppl"] == pytest.approx(want["ppl"], rel=EAGER_RTOL)
    assert got["running_ppl"] == pytest.approx(want["running_ppl"], rel=EAGER_RTOL)
    assert got["nll"] == pytest.approx(math.log(want["ppl"]), rel=EAGER_RTOL) and got["tokens_per_s"] > 0


@pytest.fixture(scope="module")
def artifact(checkpoint):
    out = checkpoint.parent / "tp2"
    assert main(["export", "--model", str(checkpoint), "--tp", "2", "--max-seq-len", str(WINDOW), "--functions", "prefill,decode", "--output-dir", str(out), "--json"]) == 0
    return out


def test_compiled_tp2_matches_eager(checkpoint, artifact, capsys):
    text = checkpoint.parent / "text.txt"
    eager = json.loads(sharktank(capsys, "perplexity", checkpoint, "--text", text, "--window", WINDOW, "--json")[1])
    compiled = json.loads(sharktank(capsys, "perplexity", artifact, "--text", text, "--window", WINDOW, "--json")[1])
    assert compiled["kind"] == "compiled" and compiled["tokens_scored"] == eager["tokens_scored"] and compiled["chunks"] == eager["chunks"]
    assert compiled["running_ppl"] == pytest.approx(eager["running_ppl"], rel=COMPILED_RTOL)
    _, out, err = sharktank(capsys, "perplexity", artifact, "--text", text, "--window", WINDOW)
    chunks = eager["chunks"]
    assert out.startswith(f"perplexity: {compiled['ppl']:.4f} ({eager['tokens_scored']} tokens scored in {chunks} chunks of {WINDOW}, ")
    assert out.endswith(" tok/s)\n") and f"[{chunks}/{chunks}] perplexity " in err


@pytest.mark.parametrize(
    "target, text, window, message",
    [
        ("artifact", TEXT, 34, "--window 34 is longer than the model's max_seq_len 32"),
        ("checkpoint", TEXT, 33, "--window must be an even integer >= 4 (its second half is scored), found 33"),
        ("checkpoint", TEXT, 2, "--window must be an even integer >= 4"),
        ("checkpoint", TEXT, 128, "--window 128 is longer than the model's max_seq_len 64"),
        ("checkpoint", SENTENCES[0], WINDOW, "the text is 16 tokens, too short for one window of 32"),
        ("checkpoint", None, WINDOW, "no such file"),
        ("bare", TEXT, WINDOW, "carries no tokenizer"),
    ],
    ids=["past-max-seq-len", "odd-window", "tiny-window", "past-context", "short-text", "missing-text", "no-tokenizer"],
)
def test_errors_are_one_line(request, checkpoint, tmp_path, capsys, target, text, window, message):
    path = tmp_path / "t.txt"
    if text is not None:
        path.write_text(text)
    if target == "bare":  # a checkpoint without tokenizer.json
        model = tmp_path / "bare"
        shutil.copytree(checkpoint, model)
        (model / "tokenizer.json").unlink()
    else:
        model = request.getfixturevalue(target)
    rc, out, err = sharktank(capsys, "perplexity", model, "--text", path, "--window", window, check=False)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1, err
