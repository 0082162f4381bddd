"""GET /metrics: Prometheus text from a live server on 127.0.0.1 over the real engine of a toy
artifact. Counts are compared with what the test sent and got back; the queue and row gauges
are read while a gate holds the engine's thread. Every wait has a deadline."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from live import LiveServer  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from toy_artifact import BATCH, MAX_SEQ_LEN, PAGE, toy_artifact  # noqa: E402

from sharktank.runtime import CompiledModel  # noqa: E402
from sharktank.serving.engine import Engine  # noqa: E402
from sharktank.serving.server import create_app  # noqa: E402
from sharktank.text.tokenizer import ByteTokenizer  # noqa: E402

MODEL = "toy"
TIMEOUT = 30


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return toy_artifact(tmp_path_factory)


class Gated:
    """The real engine; the first event it delivers waits (on the engine's thread) until
    ``release`` is set, so the engine is held mid-step while the test looks."""

    def __init__(self, engine):
        self.engine, self.held, self.release = engine, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, prompt, params, on_event):
        def gated(event):
            if not self.held.is_set():
                self.held.set()
                assert self.release.wait(TIMEOUT), "the test never released the engine"
            on_event(event)

        return self.engine.submit(prompt, params, gated)


def scrape(url: str) -> dict[str, float]:
    """``{sample name{labels}: value}`` of one /metrics answer."""
    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue  # the buckets: counts and sums are enough here
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def until(url: str, ok, what: str) -> dict[str, float]:
    deadline = time.monotonic() + TIMEOUT
    while not ok(m := scrape(url)):
        assert time.monotonic() < deadline, f"/metrics never showed {what}: {m}"
        time.sleep(0.02)
    return m


def complete(url: str, prompt: str, max_tokens: int, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_count_requests_tokens_queue_and_latency(artifact):
    gated = Gated(Engine(CompiledModel(artifact), batch_size=BATCH, max_queue=8))
    with LiveServer(create_app(gated, ByteTokenizer(), MODEL)) as s:
        try:
            _count_and_gauge(s, gated)
        finally:  # never leave the engine's thread held
            gated.release.set()


def _count_and_gauge(s: LiveServer, gated: Gated) -> None:
    """Four requests while the engine is held, then a stop string and a client that leaves."""
    m = scrape(s.url)
    assert m["sharktank_rows"] == BATCH and m["sharktank_rows_running"] == 0 and m["sharktank_requests_waiting"] == 0
    assert all(m[f"sharktank_requests_total{{finish_reason={r}}}"] == 0 for r in ("stop", "length", "cancelled", "error"))
    prompts = ["first", "second one", "third, the longest", "fourth"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        first = pool.submit(complete, s.url, prompts[0], 5)
        assert gated.held.wait(TIMEOUT), "the engine delivered no event"
        # The engine is held delivering the first request's first token: the others queue.
        rest = [pool.submit(complete, s.url, p, 5) for p in prompts[1:]]
        held = until(s.url, lambda m: m["sharktank_requests_waiting"] == 3, "3 waiting requests")
        assert held["sharktank_rows_running"] == 1 and held["sharktank_generation_tokens_total"] == 0
        gated.release.set()
        answers = [f.result(TIMEOUT) for f in [first, *rest]]
    assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)
    m = until(s.url, lambda m: m["sharktank_requests_total{finish_reason=length}"] == 4, "4 finished requests")
    assert m["sharktank_rows_running"] == 0 and m["sharktank_requests_waiting"] == 0
    # The paged cache: every page back, none held; the pool is BATCH rows' worth of pages.
    assert m["sharktank_kv_pages"] == BATCH * MAX_SEQ_LEN // PAGE and m["sharktank_kv_pages_used"] == 0
    assert m["sharktank_kv_pages_cached"] + m["sharktank_kv_pages_free"] == m["sharktank_kv_pages"]
    assert m["sharktank_preemptions"] == 0  # the default pool holds every row at full length
    assert m["sharktank_prompt_tokens_total"] == sum(len(p) for p in prompts) == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert m["sharktank_generation_tokens_total"] == 4 * 5
    assert m["sharktank_time_to_first_token_seconds_count"] == 4 and m["sharktank_inter_token_latency_seconds_count"] == 4 * 4
    assert m["sharktank_time_to_first_token_seconds_sum"] > 0 and m["sharktank_inter_token_latency_seconds_sum"] > 0

    # A stop string ends with "stop" as the client sees it; a client that leaves, "cancelled".
    text = complete(s.url, "stop here", 24)["choices"][0]["text"]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].isprintable() and text[i : i + 2] not in text[:i])
    assert complete(s.url, "stop here", 24, stop=[stop])["choices"][0]["finish_reason"] == "stop"
    gated.held.clear()  # hold the engine again, at the next request's first token
    gated.release.clear()
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", s.url + "/v1/completions", json={"model": MODEL, "prompt": "leave", "max_tokens": 50, "stream": True}):
            assert gated.held.wait(TIMEOUT), "the engine delivered no event"
    # The client left before its first token: cancelled, whatever the engine does next.
    until(s.url, lambda m: m["sharktank_requests_total{finish_reason=cancelled}"] == 1, "the cancelled request")
    gated.release.set()
    m = until(s.url, lambda m: m["sharktank_rows_running"] == 0, "the cancelled request's row freed")
    assert m["sharktank_requests_total{finish_reason=stop}"] == 1 and m["sharktank_requests_total{finish_reason=error}"] == 0
    assert m["sharktank_requests_total{finish_reason=length}"] == 5


class _Idle:
    """An engine stand-in that never runs anything (create_app only needs these)."""

    failure = None
    max_seq_len = 16

    def start(self):
        pass

    def stop(self):
        pass


def test_each_app_has_its_own_registry():
    a, b = (create_app(_Idle(), ByteTokenizer(), MODEL) for _ in range(2))  # the global registry would refuse the second
    ma, mb = a.state.serving.metrics, b.state.serving.metrics
    assert ma.registry is not mb.registry
    ma.finished("length")
    assert b"sharktank_requests_total{finish_reason=\"length\"} 1.0" in ma.render()
    assert b"sharktank_requests_total{finish_reason=\"length\"} 0.0" in mb.render()
    assert b"sharktank_rows_running 0.0" in mb.render()  # not loaded: the gauges read 0
