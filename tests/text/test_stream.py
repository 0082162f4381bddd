"""DetokenizeStream: text is emitted once final, never a stop string or anything after it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharktank.text import ByteTokenizer, DetokenizeStream, HFTokenizer
from tiny import SENTENCES, reference, tiny_bpe

BYTES = ByteTokenizer()


def run(stream: DetokenizeStream, ids) -> list[tuple[str, bool]]:
    return [stream.push(i) for i in ids]


def test_multibyte_characters_split_across_tokens_come_out_whole():
    s = DetokenizeStream(BYTES)
    got = run(s, "aé日🦊".encode())
    # a | é = C3 A9 | 日 = E6 97 A5 | 🦊 = F0 9F A6 8A: text appears on each character's last byte.
    assert [t for t, _ in got] == ["a", "", "é", "", "", "日", "", "", "", "🦊"]
    assert not any(stopped for _, stopped in got) and s.text == "aé日🦊" and s.finish() == ""


@given(st.lists(st.integers(0, 255), max_size=40))
def test_any_bytes_stream_to_what_python_decodes(ids):
    s = DetokenizeStream(BYTES)
    pieces = [t for t, _ in run(s, ids)]
    assert "".join(pieces) + s.finish() == bytes(ids).decode("utf-8", errors="replace")


@given(st.text(alphabet=st.sampled_from(list("The fox 日本語 é🦊✨\n12")), max_size=30))
def test_bpe_stream_equals_reference_decode(text):
    ref = reference()
    ids = ref.encode(text, add_special_tokens=False)
    s = DetokenizeStream(HFTokenizer(tiny_bpe()))
    pieces = [t for t, _ in run(s, ids)]
    assert "".join(pieces) + s.finish() == ref.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_cuts_exactly_before_it():
    tok = HFTokenizer(tiny_bpe())
    text = SENTENCES[0]  # "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "fox jumps"
    # The stop string is more than one token, and starts inside a token's text (" fox").
    pieces = [tok.decode([i]) for i in ids]
    assert stop not in pieces and not any(p.startswith("fox") for p in pieces)
    s = DetokenizeStream(tok, stop=[stop])
    got = run(s, ids)
    first_stop = next(k for k, (_, stopped) in enumerate(got) if stopped)
    assert "".join(t for t, _ in got) == s.text == "The quick brown "
    # It stops on the token completing "fox jumps", and pushes after that give nothing.
    assert tok.decode(ids[: first_stop + 1]).endswith("jumps") and not tok.decode(ids[:first_stop]).endswith("jumps")
    assert all(t == "" and stopped for t, stopped in got[first_stop + 1 :]) and s.finish() == ""


def test_a_false_start_of_a_stop_string_is_held_then_released():
    s = DetokenizeStream(BYTES, stop=["STOP"])
    got = run(s, b"ab STOMP STOP after")
    texts = [t for t, _ in got]
    assert texts[:3] == ["a", "b", " "]
    assert texts[3:6] == ["", "", ""]           # "STO" could begin "STOP"
    assert texts[6:8] == ["STOM", "P"]           # "M" rules it out
    assert "".join(texts) == s.text == "ab STOMP "
    assert [stopped for _, stopped in got].index(True) == len("ab STOMP STOP") - 1


def test_the_earliest_of_several_stop_strings_wins_and_finish_returns_a_held_prefix():
    s = DetokenizeStream(BYTES, stop=["world", "lo w"])
    run(s, b"hello world")
    assert s.text == "hel" and s.stopped
    s = DetokenizeStream(BYTES, stop=["\n\n"])
    got = run(s, b"line\n")
    assert "".join(t for t, _ in got) == "line" and s.finish() == "\n" and s.text == "line\n"


def test_an_unfinished_character_comes_out_on_finish_as_replacement():
    s = DetokenizeStream(BYTES)
    assert run(s, b"ok\xe6\x97") == [("o", False), ("k", False), ("", False), ("", False)]
    assert s.finish() == "\ufffd"


def test_special_tokens_emit_nothing_and_stop_strings_must_be_text():
    tok = HFTokenizer(tiny_bpe())
    s = DetokenizeStream(tok)
    assert s.push(tok.tokenizer.token_to_id("<s>")) == ("", False)
    with pytest.raises(ValueError, match="non-empty strings"):
        DetokenizeStream(tok, stop=[""])
