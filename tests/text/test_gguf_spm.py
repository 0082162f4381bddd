"""SentencePiece GGUF tokenizers (tokenizer.ggml.model "llama") against sentencepiece itself.

Models of both types (BPE, unigram) are trained here, as Llama 2 / Mistral ones are (byte fallback,
identity normalization, digits split, the "▁" dummy prefix), written into a GGUF as llama.cpp's
converter writes one, and ours, built from that GGUF, must encode and decode as sentencepiece does."""

from __future__ import annotations

import io

import pytest

from hard_strings import HARD
from sharktank.text import tokenizer_from_gguf
from sharktank.text._gguf import UnsupportedTokenizer
from sharktank.text.spm import spm_algorithm

TEXT = """The quick brown fox jumps over the lazy dog. Sharding splits the weights of a model across devices.
Café, naïve, façade: déjà vu in the résumé. Numbers 12345 and 2024-06-01, tabs\tand  double  spaces.
def main():
    for i in range(10):
        print(i, "hello world")
    return None
if a < b and b > c: I don't know, I'LL see. We've been there; they're here!!! ... ??? --- === (a) [b] {c}
the the the model model devices devices weights tokens tokenizer tokenization Ångström
""".splitlines() * 4
USER_DEFINED, CONTROL = ["<tool>"], ["<|eot|>", "<|eom|>"]


def train(model_type: str, *, dummy_prefix: bool = True):
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=out, model_type=model_type, vocab_size=420, hard_vocab_limit=False,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
        user_defined_symbols=USER_DEFINED, control_symbols=CONTROL, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def token_type(sp, i: int) -> int:
    """llama.cpp's converter: unknown 2, control 3, unused 5, byte 6, else normal 1; user-defined 4
    (the symbols the model was trained with)."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_unused(i):
        return 5
    if sp.is_byte(i):
        return 6
    return 4 if sp.id_to_piece(i) in USER_DEFINED else 1


def write_gguf(path, sp, *, add_eos=False, space_prefix=None, model="llama") -> None:
    from gguf import GGUFWriter

    n = sp.get_piece_size()
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([token_type(sp, i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_eot_token_id(sp.piece_to_id("<|eot|>"))
    w.add_eom_token_id(sp.piece_to_id("<|eom|>"))
    w.add_add_eos_token(add_eos)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def pair(request, tmp_path_factory):
    """(model type, sentencepiece, ours from its GGUF)."""
    sp = train(request.param)
    path = tmp_path_factory.mktemp(request.param) / "spm.gguf"
    write_gguf(path, sp)
    return request.param, sp, tokenizer_from_gguf(path)


def test_the_scores_say_which_algorithm(pair):
    kind, sp, _ = pair
    n = sp.get_piece_size()
    assert spm_algorithm([sp.get_score(i) for i in range(n)], [token_type(sp, i) for i in range(n)]) == kind


def test_encodes_and_decodes_as_sentencepiece(pair):
    kind, sp, tok = pair
    ties = []
    for text in HARD + ["literal <0x41> text"]:  # a byte piece's name in the text is not the byte
        ids, want = tok.encode(text, add_special_tokens=False), sp.encode(text)
        assert tok.decode(ids) == sp.decode(ids) == text, (kind, text)
        if ids != want and kind == "unigram" and sorted(ids) == sorted(want):
            # The same pieces in another order: an exact tie of the two paths' scores, which
            # sentencepiece breaks by float32 rounding of its running sums (tokenizers sums in float64).
            ties.append(text)
            continue
        assert ids == want, (kind, text)
    assert len(ties) * 10 < len(HARD), ties
    assert not any(sp.is_byte(i) for i in sp.encode("<0x41>"))  # "<", "0", "x", "4", "1", ">" are pieces
    # The hard strings reach byte fallback (characters outside the pieces).
    assert any(sp.is_byte(i) for i in sp.encode("日本語 🦊"))


def test_bos_eos_eot_eom_and_unknown_ids(pair, tmp_path):
    kind, sp, tok = pair
    assert tok.bos_token_id == sp.bos_id() == 1
    assert tok.eos_token_ids == (sp.eos_id(), sp.piece_to_id("<|eot|>"), sp.piece_to_id("<|eom|>"))
    assert tok.encode("Hello world") == [sp.bos_id()] + sp.encode("Hello world")  # add_bos_token: llama's default
    assert tok.encode("") == [sp.bos_id()]
    write_gguf(tmp_path / "eos.gguf", sp, add_eos=True)
    assert tokenizer_from_gguf(tmp_path / "eos.gguf").encode("fox") == [sp.bos_id()] + sp.encode("fox") + [sp.eos_id()]
    assert tok.tokenizer.id_to_token(sp.unk_id()) == "<unk>"


def test_control_and_user_defined_tokens_split_the_text(pair):
    """Control and user-defined tokens are matched whole; the text after one starts afresh with its
    own space prefix (llama.cpp's rule: sentencepiece run on each piece of text between them)."""
    kind, sp, tok = pair
    eot, tool = sp.piece_to_id("<|eot|>"), sp.piece_to_id("<tool>")
    for text, parts in [
        ("hi<|eot|>there", ["hi", eot, "there"]),
        ("<|eot|> 42 <tool>(x)", [eot, " 42 ", tool, "(x)"]),
        ("a<tool>b<|eom|>", ["a", tool, "b", sp.piece_to_id("<|eom|>")]),
    ]:
        want = [i for p in parts for i in (sp.encode(p) if isinstance(p, str) else [p])]
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == want, (kind, text)
        assert tok.decode(ids) == sp.decode([i for i in ids if not sp.is_control(i)])  # control tokens are skipped
    # Alone, a user-defined token is just itself (sentencepiece would put its dummy "▁" before it).
    assert tok.encode("<tool>", add_special_tokens=False) == [tool]
    assert sp.encode("<tool>") == [sp.piece_to_id("▁"), tool]


def test_without_the_space_prefix(tmp_path):
    sp = train("bpe", dummy_prefix=False)
    write_gguf(tmp_path / "t.gguf", sp, space_prefix=False)
    tok = tokenizer_from_gguf(tmp_path / "t.gguf")
    for text in HARD:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text) and tok.decode(ids) == text, text
    assert sp.id_to_piece(tok.encode("fox", add_special_tokens=False)[0])[0] != "▁"


def test_an_unknown_model_or_missing_scores_is_refused(tmp_path):
    sp = train("bpe")
    write_gguf(tmp_path / "t5.gguf", sp, model="t5")
    with pytest.raises(UnsupportedTokenizer, match=r"model 't5' is not supported; supported: 'gpt2' \(byte-level BPE\), 'llama' \(SentencePiece\)"):
        tokenizer_from_gguf(tmp_path / "t5.gguf")


def test_known_difference_a_byte_pieces_name_with_an_unknown_character(pair):
    """Ledger: tokenizers' Unigram matches every vocabulary entry, and scores an unknown character
    below any entry, so where a character of "<0xE6>" ("E" here) is outside the pieces the literal
    text becomes byte 0xE6; sentencepiece never matches byte pieces. BPE has no such case."""
    kind, sp, tok = pair
    text = "<0xE6>"
    assert sp.piece_to_id("E") == sp.unk_id() and sp.piece_to_id(text) not in sp.encode(text)
    ours = tok.encode(text, add_special_tokens=False)
    assert (ours == sp.encode(text)) == (kind == "bpe"), ours
    assert (ours == [sp.piece_to_id("▁"), sp.piece_to_id(text)]) == (kind == "unigram")


def test_the_saved_tokenizer_json_reloads_equal(pair, tmp_path):
    """An export copies the built tokenizer as tokenizer.json; read back it encodes the same."""
    from sharktank.text import HFTokenizer

    kind, _, tok = pair
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
    again = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    for text in HARD + ["a<tool>b<|eot|>c"]:
        assert again.encode(text) == tok.encode(text) and again.decode(again.encode(text)) == tok.decode(tok.encode(text)), (kind, text)
