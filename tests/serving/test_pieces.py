"""How a request's engine events become stream pieces (``_Generation.pieces``), with a stand-in
engine that delivers events on its own thread as the real one does: tokens that queued while
the event loop was busy go out as one piece, none is lost or repeated."""

from __future__ import annotations

import asyncio
import threading

from sharktank.serving.engine import Event
from sharktank.serving.server import ServerState, _Generation
from sharktank.text.sampling import SamplingParams
from sharktank.text.tokenizer import ByteTokenizer


class _Request:
    def cancel(self) -> None:
        pass


class _Engine:
    """Takes one request; ``send(events)`` delivers them from another thread, all at once."""

    max_seq_len = 64

    def submit(self, prompt, params, on_event):
        self.on_event = on_event
        return _Request()

    def send(self, events) -> None:
        t = threading.Thread(target=lambda: [self.on_event(e) for e in events])
        t.start()
        t.join(10)


def _pieces(events: list[Event], before_first_read: bool) -> list[tuple[str, list[int], str | None]]:
    async def main():
        engine = _Engine()
        gen = _Generation(ServerState("toy", engine=engine, tokenizer=ByteTokenizer()), [65], SamplingParams(max_tokens=8), [])
        if before_first_read:  # the loop was busy while all of them arrived
            engine.send(events)
            await asyncio.sleep(0)  # the call_soon_threadsafe puts run
        else:
            asyncio.get_running_loop().call_later(0.01, engine.send, events)
        out = []
        async for piece in gen.pieces(None):
            out.append(piece)
            if not before_first_read and len(out) == 1:
                await asyncio.sleep(0)
        return out

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_queued_tokens_make_one_piece_in_order():
    events = [Event(ord(c), None) for c in "hello"] + [Event(ord("!"), "length")]
    pieces = _pieces(events, before_first_read=True)
    assert pieces == [("hello!", [ord(c) for c in "hello!"], "length")]


def test_tokens_arriving_one_by_one_are_not_lost_or_repeated():
    events = [Event(ord(c), None) for c in "abc"] + [Event(ord("d"), "length")]
    pieces = _pieces(events, before_first_read=False)
    assert "".join(p[0] for p in pieces) == "abcd"
    assert [i for p in pieces for i in p[1]] == [ord(c) for c in "abcd"]
    assert pieces[-1][2] == "length" and all(p[2] is None for p in pieces[:-1])
