"""`sharktank serve` end to end: a live server on 127.0.0.1 over the real engine and tokenizer
of a toy-llama artifact, driven by the real `openai` client and by httpx for raw requests.

Outputs are compared with `sharktank run` and with the same request sent alone, never with
stored values. Every server is stopped in its fixture's finalizer; every wait has a timeout.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from bench_serve import served  # noqa: E402
from cli.test_export_run import sharktank  # noqa: E402
from live import LiveServer  # noqa: E402

from sharktank.runtime import CompiledModel  # noqa: E402
from sharktank.serving.engine import Engine  # noqa: E402
from sharktank.serving.server import create_app  # noqa: E402
from sharktank.text.tokenizer import ByteTokenizer, render_chat_template  # noqa: E402

MODEL = "toy"
TIMEOUT = 30  # seconds, for any one request


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "toy"
    sharktank("export", "--model", "toy-llama", "--batch-sizes", "1,8", "--output-dir", out, "--json")
    return out


def _engine(artifact, **kw):
    return Engine(CompiledModel(artifact), **kw)


@pytest.fixture(scope="module")
def server(artifact):
    with LiveServer(create_app(_engine(artifact, batch_size=8, max_queue=64), ByteTokenizer(), MODEL)) as s:
        yield s


def client(s: LiveServer):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)


def complete(s: LiveServer, prompt, max_tokens: int, **kw) -> dict:
    r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **kw}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def stream_ids(s: LiveServer, prompt, max_tokens: int) -> tuple[list[int], str, str, dict]:
    """(ids, text, finish_reason, usage) of a streamed greedy completion through the openai client."""
    ids, text, finish, usage = [], "", None, None
    chunks = client(s).completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
            continue
        choice = chunk.choices[0]
        ids += choice.model_extra["token_ids"]
        text += choice.text
        finish = choice.finish_reason or finish
    return ids, text, finish, usage


# --- results ------------------------------------------------------------------------------------
def test_greedy_completion_equals_sharktank_run(server, artifact):
    prompt = "Hello, server"
    run = json.loads(sharktank("run", artifact, "--prompt", prompt, "--max-new-tokens", 12, "--json").stdout)
    r = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == run["ids"] and choice.text == run["text"]
    assert choice.finish_reason == "length" == run["finish_reason"]
    assert (r.object, r.model, r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == ("text_completion", MODEL, len(prompt), 12, len(prompt) + 12)
    assert r.id.startswith("cmpl-") and r.created > 0
    # A prompt of token ids is the same request.
    assert complete(server, run["prompt_ids"], 12)["choices"][0]["token_ids"] == run["ids"]
    # Streamed: the same ids and text, ending in [DONE], with the usage chunk.
    ids, text, finish, usage = stream_ids(server, prompt, 12)
    assert (ids, text, finish) == (run["ids"], run["text"], "length")
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12, **{k: v for k, v in usage.items() if k.endswith("details")}}
    raw = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True}, timeout=TIMEOUT)
    events = [e for e in raw.text.split("\n\n") if e]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_eight_concurrent_streams_equal_each_alone(server):
    cases = [(f"request {i}: " + "x" * (3 * i), 6 + 5 * i) for i in range(8)]
    alone = [complete(server, p, n)["choices"][0] for p, n in cases]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: stream_ids(server, *c), cases, timeout=3 * TIMEOUT))
    for (p, n), one, (ids, text, finish, usage) in zip(cases, alone, together):
        assert len(ids) == n and finish == "length" and usage["completion_tokens"] == n
        assert (ids, text) == (one["token_ids"], one["text"]), p


def test_stop_string_ends_with_finish_reason_stop(server):
    full = complete(server, "stop here", 24)["choices"][0]
    text = full["text"]
    # A stop string taken from the greedy text itself: the answer is the text before it.
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].isprintable() and text[i : i + 2] not in text[:i])
    cut = complete(server, "stop here", 24, stop=[stop, "\x00never"])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    assert full["token_ids"][: len(cut["token_ids"])] == cut["token_ids"] and len(cut["token_ids"]) < 24
    events = client(server).completions.create(model=MODEL, prompt="stop here", max_tokens=24, temperature=0, stop=stop, stream=True)
    chunks = list(events)
    assert "".join(c.choices[0].text for c in chunks) == cut["text"] and chunks[-1].choices[0].finish_reason == "stop"


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(server.url + "/health", timeout=TIMEOUT)
    assert h.status_code == 200 and h.json()["status"] == "ok"


# --- errors -------------------------------------------------------------------------------------
def _post(s, path, body, **kw):
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(s.url + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT, **kw)


ERRORS = {
    "malformed JSON": ("/v1/completions", '{"model": "toy", "prompt": ', 400, None),
    "prompt of the wrong type": ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    "max_tokens as a string": ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": "3"}, 400, "max_tokens"),
    "temperature out of range": ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    "unknown model": ("/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    "prompt longer than the context": ("/v1/completions", {"model": MODEL, "prompt": "a" * 200}, 400, "prompt"),
    "max_tokens past the cache": ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 500}, 400, "max_tokens"),
    "empty prompt": ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    "token id outside the vocabulary": ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, 400, "prompt"),
    "n > 1": ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 2}, 400, "n"),
    "empty stop string": ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [""]}, 400, "stop"),
    "chat without a chat template": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, case):
    path, body, status, param = ERRORS[case]
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert complete(server, "next", 2)["choices"][0]["finish_reason"] == "length"


class SlowConsumer:
    """The real engine; every event it delivers first waits ``delay`` seconds on the engine's
    thread (a slow client), and each request's events are recorded."""

    def __init__(self, engine, delay: float):
        self.engine, self.delay, self.events = engine, delay, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, prompt, params, on_event):
        log: list = []

        def slow(event):
            log.append(event)
            time.sleep(self.delay)
            on_event(event)

        request = self.engine.submit(prompt, params, slow)
        self.events.append(log)
        return request


@pytest.fixture
def slow_server(artifact):
    engine = SlowConsumer(_engine(artifact, batch_size=1, max_queue=1), 0.02)
    with LiveServer(create_app(engine, ByteTokenizer(), MODEL)) as s:
        yield s, engine


def _running(s, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(s.url + "/health", timeout=TIMEOUT).json()["running"] != n:
        assert time.monotonic() < deadline, f"/health did not report {n} running requests within {timeout} s: {httpx.get(s.url + '/health').json()}"
        time.sleep(0.02)


def _finished(log: list, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not (log and log[-1].finish_reason):
        assert time.monotonic() < deadline, "the engine sent no last event"
        time.sleep(0.02)
    return log[-1].finish_reason


def test_full_queue_gets_429_and_a_disconnect_frees_the_row(slow_server):
    s, engine = slow_server
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 100, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", s.url + "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # kept: dropping the iterator closes the stream
            next(lines)  # the first chunk: it holds the one row
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(complete, s, "queued", 3)  # waits in the queue of one
                _running(s, 2)
                full = _post(s, "/v1/completions", {"model": MODEL, "prompt": "one too many", "max_tokens": 3})
                assert full.status_code == 429, full.text
                assert full.json()["error"]["code"] == "queue_full" and full.headers["retry-after"]
                # The client of the first request goes away mid-stream.
                first.close()
                assert waiting.result(TIMEOUT)["choices"][0]["finish_reason"] == "length"
    assert _finished(engine.events[0]) == "cancelled"  # the engine freed its row
    assert len(engine.events[0]) < 100
    _running(s, 0)
    assert complete(s, "after", 3)["choices"][0]["finish_reason"] == "length"


# --- loading ------------------------------------------------------------------------------------
def test_health_is_503_until_the_model_is_loaded(artifact):
    go = threading.Event()

    def load():
        assert go.wait(TIMEOUT), "the test never released the load"
        return _engine(artifact, batch_size=1), ByteTokenizer()

    with LiveServer(create_app(None, None, MODEL, load=load)) as s:
        try:
            h = httpx.get(s.url + "/health", timeout=TIMEOUT)
            assert h.status_code == 503 and h.json()["status"] == "loading"
            early = _post(s, "/v1/completions", {"model": MODEL, "prompt": "a"})
            assert early.status_code == 503 and early.json()["error"]["code"] == "model_not_ready"
        finally:
            go.set()
        deadline = time.monotonic() + TIMEOUT
        while httpx.get(s.url + "/health", timeout=TIMEOUT).status_code != 200:
            assert time.monotonic() < deadline, "/health never answered 200"
            time.sleep(0.02)
        assert complete(s, "loaded", 2)["choices"][0]["finish_reason"] == "length"


# --- chat ---------------------------------------------------------------------------------------
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


class ChatByteTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template (the toy model's vocabulary is bytes)."""

    chat_template = CHAT_TEMPLATE

    def apply_chat_template(self, messages):
        return render_chat_template(CHAT_TEMPLATE, messages, bos_token="", eos_token="")


@pytest.fixture
def chat_server(artifact):
    with LiveServer(create_app(_engine(artifact, batch_size=8), ChatByteTokenizer(), MODEL)) as s:
        yield s


def test_chat_completion_is_the_completion_of_the_rendered_template(chat_server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt = ChatByteTokenizer().apply_chat_template(messages)
    want = complete(chat_server, prompt, 10)["choices"][0]
    c = client(chat_server)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want["text"]
    assert r.choices[0].model_extra["token_ids"] == want["token_ids"] and r.usage.prompt_tokens == len(prompt)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want["text"]
    bad = _post(chat_server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


# --- command line -------------------------------------------------------------------------------
def test_sharktank_serve_command(artifact, tmp_path):
    help_text = sharktank("serve", "--help").stdout
    for option in ("--host", "--port", "--max-batch", "--max-queue", "--model-name", "--driver", "127.0.0.1"):
        assert option in help_text
    bad = sharktank("serve", tmp_path, check=False)
    assert bad.returncode == 2 and "no manifest.json" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    with served(str(artifact), "--max-batch", "1", start_timeout=60) as url:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "toy", "prompt": "cli", "max_tokens": 3}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
