"""Text through the command line: export copies the tokenizer into the artifact (sha256 in
the manifest), `run --prompt` encodes, generates and prints text; changed tokenizers are refused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from reliability.reltools import TOY_MAX_SEQ_LEN, shared_toy
from sharktank.cli import main
from sharktank.text import HFTokenizer, TokenizerError, load_tokenizer
from sharktank.text.tokenizer import export_tokenizer
from tiny import CHAT_TEMPLATE, SENTENCES, reference, write_gguf_stub, write_gguf_tokenizer, write_tiny_checkpoint


def sharktank(capsys, *args, check=True):
    """The command line in this process (no interpreter start-up): (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    if check and rc != 0:
        raise AssertionError(f"sharktank {' '.join(map(str, args))} failed ({rc}):\n{err[-3000:]}")
    return rc, out, err


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The compiled toy-llama (tp 1, batch 1, prefill and decode, the byte tokenizer) that the
    reliability tests read too, built once per run; a cache of TOY_MAX_SEQ_LEN."""
    return shared_toy(tmp_path_factory)


def test_prompt_generates_the_greedy_ids_of_its_bytes(toy, capsys):
    assert json.loads((toy / "manifest.json").read_text())["tokenizer"] == {"kind": "bytes"}
    prompt = "héllo 🦊"
    r = json.loads(sharktank(capsys, "run", toy, "--prompt", prompt, "--max-new-tokens", "12", "--json")[1])
    prompt_ids = list(prompt.encode("utf-8"))
    want = json.loads(sharktank(capsys, "run", toy, "--tokens", ",".join(map(str, prompt_ids)), "--max-new-tokens", "12", "--json")[1])
    assert r["prompt_ids"] == prompt_ids and r["ids"] == want["ids"] and len(r["ids"]) == 12
    assert r["text"] == bytes(r["ids"]).decode("utf-8", errors="replace") and r["finish_reason"] == "length"
    # A stop string taken from that text: the printed text ends just before it, generation stops there.
    text = r["text"]
    k = next(k for k in range(1, len(text) - 2) if text.find(text[k : k + 2]) == k)
    _, out, err = sharktank(capsys, "run", toy, "--prompt", prompt, "--max-new-tokens", "12", "--stop", text[k : k + 2])
    assert out == text[:k] + "\n" and "tokens (stop)" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("--max-new-tokens", str(TOY_MAX_SEQ_LEN - 1)),
         f"the prompt's 2 tokens + --max-new-tokens {TOY_MAX_SEQ_LEN - 1} exceed the exported cache length {TOY_MAX_SEQ_LEN}"),
        (("--temperature", "-1"), "temperature must be a number in [0, 100], found -1.0"),
        (("--chat",), "this tokenizer (bytes) has no chat template"),
    ],
)
def test_prompt_errors_are_one_line(toy, capsys, args, message):
    rc, _, err = sharktank(capsys, "run", toy, "--prompt", "hi", *args, check=False)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_prompt_and_tokens_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["run", "somewhere", "--prompt", "hi", "--tokens", "1,2"])
    assert "argument --tokens: not allowed with argument --prompt" in capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", layers=1, heads=2, kv_heads=1)


def test_hf_export_copies_the_tokenizer_and_refuses_a_changed_one(checkpoint, tmp_path, capsys):
    out = tmp_path / "art"
    sharktank(capsys, "export", "--model", checkpoint, "--max-seq-len", "16", "--no-compile", "--output-dir", out)
    entry = json.loads((out / "manifest.json").read_text())["tokenizer"]
    copied = (out / "tokenizer.json").read_bytes()
    assert copied == (checkpoint / "tokenizer.json").read_bytes()
    assert entry == {"kind": "hf", "file": "tokenizer.json", "sha256": hashlib.sha256(copied).hexdigest(),
                     "chat_template": CHAT_TEMPLATE, "eos_token_ids": [1], "bos_token_id": 0}
    tok, ref = load_tokenizer(out), reference()
    for text in SENTENCES:
        assert tok.encode(text) == ref.encode(text)
    assert "tokenizer: hf tokenizer.json, EOS ids [1]" in sharktank(capsys, "inspect", out)[1]
    (out / "tokenizer.json").write_bytes(copied.replace(b'"fox"', b'"cat"', 1) if b'"fox"' in copied else copied + b" ")
    with pytest.raises(TokenizerError, match="tokenizer.json: sha256 [0-9a-f]{16}… does not match .*manifest.json's"):
        load_tokenizer(out)
    rc, _, err = sharktank(capsys, "run", out, "--prompt", "hi", check=False)
    assert rc == 2 and "sha256" in err and "the tokenizer changed or is corrupt" in err


def test_sources_without_a_tokenizer_give_none_and_run_says_so(checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    assert export_tokenizer(str(bare), tmp_path, vocab_size=400) is None
    assert export_tokenizer("toy-llama", tmp_path, vocab_size=256) == {"kind": "bytes"}
    notes = []
    for model in (None, "t5"):  # no tokenizer metadata; T5's unigram (UGM), not built here
        write_gguf_stub(tmp_path / "m.gguf", model)
        assert export_tokenizer(str(tmp_path / "m.gguf"), tmp_path, vocab_size=256, progress=notes.append) is None
    assert "model 't5' is not supported" in notes[-1]
    assert not (tmp_path / "tokenizer.json").exists()
    # An artifact whose manifest names no tokenizer: `run --prompt` says so.
    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text(json.dumps({"format": "sharktank.artifact"}))
    assert load_tokenizer(art) is None
    rc, _, err = sharktank(capsys, "run", art, "--prompt", "hi", check=False)
    assert rc == 2 and "the artifact has no tokenizer" in err and "--tokens" in err


def test_gguf_source_tokenizer_is_built_and_saved(tmp_path):
    src = tmp_path / "m.gguf"
    write_gguf_tokenizer(src)
    (tmp_path / "art").mkdir()
    entry = export_tokenizer(str(src), tmp_path / "art", vocab_size=400)
    assert entry["kind"] == "hf" and entry["eos_token_ids"] == [1] and entry["bos_token_id"] == 0 and entry["chat_template"] == CHAT_TEMPLATE
    saved, ref = HFTokenizer.from_file(tmp_path / "art" / "tokenizer.json"), reference()
    for text in SENTENCES + ["<s>x</s>"]:
        assert saved.encode(text) == ref.encode(text) and saved.decode(saved.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    with pytest.raises(TokenizerError, match="the tokenizer has 400 tokens, more than the model's vocab_size 256"):
        export_tokenizer(str(src), tmp_path / "art", vocab_size=256)
