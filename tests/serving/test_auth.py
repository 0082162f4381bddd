"""--api-key: Bearer auth on the /v1 routes of a live server on 127.0.0.1 (the real engine of a
toy artifact), driven by the openai client and by httpx; /health and /metrics stay open.
Every server is stopped at the end of its fixture or test; every wait has a timeout."""

from __future__ import annotations

import sys
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
from toy_artifact import BATCH, toy_artifact  # noqa: E402

from sharktank.runtime import CompiledModel  # noqa: E402
from sharktank.serving.auth import key_matches  # noqa: E402
from sharktank.serving.engine import Engine  # noqa: E402
from sharktank.serving.server import create_app  # noqa: E402
from sharktank.text.tokenizer import ByteTokenizer  # noqa: E402

MODEL = "toy"
KEY = "sk-test-0123456789"
TIMEOUT = 30


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return toy_artifact(tmp_path_factory)


@pytest.fixture(scope="module")
def server(artifact):
    app = create_app(Engine(CompiledModel(artifact), batch_size=BATCH), ByteTokenizer(), MODEL, api_key=KEY)
    with LiveServer(app) as s:
        yield s


def client(s: LiveServer, key: str):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


def _unauthorized(r) -> dict:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None)
    return err


@pytest.mark.parametrize(
    "header, ok",
    [
        (None, False), ("", False), ("Bearer", False), (f"Bearer {KEY}", True), (f"bearer {KEY}", True),
        (f"Basic {KEY}", False), (f"Bearer {KEY}x", False), (f"Bearer {KEY[:-1]}", False), (KEY, False), ("Bearer ké", False),
    ],
)
def test_key_matches_only_the_bearer_key(header, ok):
    assert key_matches(header, KEY) is ok


def test_the_openai_client_with_the_key_is_served(server):
    c = client(server, KEY)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="with a key", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    chunks = list(c.completions.create(model=MODEL, prompt="with a key", max_tokens=4, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


def test_a_wrong_key_gets_401_from_the_openai_client(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "sk-wrong").completions.create(model=MODEL, prompt="no", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-wrong").models.list()


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/nowhere"])
def test_missing_or_wrong_keys_get_401_before_the_body_is_read(server, path):
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": f"Token {KEY}"}):
        # A malformed body too: the key is checked first, so nothing about the API leaks.
        r = httpx.post(server.url + path, content="{not json", headers={"content-type": "application/json", **headers}, timeout=TIMEOUT)
        err = _unauthorized(r)
        assert ("didn't provide" in err["message"]) == (not headers)


def test_health_and_metrics_stay_open(server):
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    r = httpx.get(server.url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and "sharktank_requests_total" in r.text


def test_sharktank_serve_takes_the_key_from_the_environment(artifact, monkeypatch):
    help_text = sharktank("serve", "--help").stdout
    for words in ("--api-key", "SHARKTANK_API_KEY", "/metrics stay open"):
        assert words in " ".join(help_text.split())
    empty = sharktank("serve", artifact, "--api-key", "", check=False)
    assert empty.returncode == 2 and "must not be empty" in empty.stderr and len(empty.stderr.strip().splitlines()) == 1
    monkeypatch.setenv("SHARKTANK_API_KEY", KEY)
    with served(str(artifact), "--max-batch", str(BATCH), start_timeout=60) as url:
        body = {"model": Path(artifact).name, "prompt": "cli", "max_tokens": 2}
        _unauthorized(httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT))
        r = httpx.post(url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
