"""Streaming detokenization: the text of each new token as soon as it is final.

Text is final when no later token can change it: it does not end in an incomplete UTF-8
character (which the tokenizers decode as U+FFFD), and it cannot be the beginning of a stop
string. Text from a stop string on is never emitted.
"""

from __future__ import annotations

from typing import Sequence

from .tokenizer import Tokenizer

__all__ = ["DetokenizeStream"]

# Decoded text ending in U+FFFD may be a character whose last bytes are still to come. It is
# held until a complete character follows (or finish): then the text ends on a character
# boundary, so decoding on from there agrees with decoding the whole sequence.
_REPLACEMENT = "\ufffd"


class DetokenizeStream:
    """Incremental decode of one sequence's generated ids, cut at the first ``stop`` string."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, found {list(stop)!r}")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.text = ""
        self.stopped = False
        self._ids: list[int] = []
        # Decoding restarts at _prefix so a token decodes with its left context (byte-level
        # and SentencePiece decoders treat the first token of a sequence specially);
        # ids before _read are already in the decoded text.
        self._prefix = self._read = 0
        self._held = ""  # decoded, not emitted: it could begin a stop string

    def push(self, token_id: int) -> tuple[str, bool]:
        """``(new final text, stopped)`` after one more generated token."""
        if self.stopped:
            return "", True
        self._ids.append(int(token_id))
        done = self._decode_new(final=False)
        return self._emit(done, final=False), self.stopped

    def finish(self) -> str:
        """The held-back remainder once generation ended (an unmatched stop-string prefix,
        an incomplete character decoded as U+FFFD)."""
        if self.stopped:
            return ""
        out = self._emit(self._decode_new(final=True), final=True)
        self.stopped = True
        return out

    def _decode_new(self, *, final: bool) -> str:
        before = self.tokenizer.decode(self._ids[self._prefix : self._read])
        now = self.tokenizer.decode(self._ids[self._prefix :])
        if not final and (len(now) <= len(before) or now.endswith(_REPLACEMENT)):
            return ""  # nothing yet, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def _emit(self, new: str, *, final: bool) -> str:
        buf = self._held + new
        cut = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            out, self._held, self.stopped = buf[:cut], "", True
        else:
            keep = 0 if final else _stop_prefix_length(buf, self.stop)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
