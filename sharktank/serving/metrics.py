"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own so several
servers in one process (tests) keep separate counts.

Counters: requests ended, by finish reason as the client saw it (``stop`` includes stop
strings, ``cancelled`` includes clients that left); prompt tokens prefilled; tokens generated.
Gauges, read from the engine when scraped: requests waiting for a row, rows in use, rows in
all, and with a paged cache its pages (in the pool, used, cached, free), the prompt tokens
the prefix cache supplied and the requests preempted. Histograms: time to first token (from
submit to the engine delivering the first token) and the gap between a request's successive
tokens, both timed on the engine's thread.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .events import FinishReason

__all__ = ["ServingMetrics", "RequestTimer", "CONTENT_TYPE"]

# The classic text format, which generate_latest writes and every Prometheus reads (newer
# prometheus-client versions name 1.0.0 as latest; with these plain names the text is the same).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "sharktank_"
# Seconds: a toy model's token takes ~1 ms on a CPU, a 1B model's prefill up to seconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineGauges:
    """Gauges computed at scrape time from ``stats()`` (an ``EngineStats``, or None while the
    model loads: then all are 0)."""

    def __init__(self, stats: Callable[[], object | None]):
        self._stats = stats

    def describe(self) -> list:
        return [GaugeMetricFamily(PREFIX + name, text) for name, text, _ in _GAUGES]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        for name, text, field in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, text, value=getattr(stats, field) if stats is not None else 0)


_GAUGES = (
    ("requests_waiting", "Requests waiting for a free batch row.", "waiting"),
    ("rows_running", "Batch rows holding a request.", "running"),
    ("rows", "Batch rows in all (the engine's batch size).", "batch_size"),
    ("kv_pages", "KV-cache pages in the pool (0: a contiguous cache).", "kv_pages"),
    ("kv_pages_used", "KV-cache pages held by running requests.", "kv_pages_used"),
    ("kv_pages_cached", "KV-cache pages held by no request, kept for prefix reuse (evicted when needed).", "kv_pages_cached"),
    ("kv_pages_free", "KV-cache pages holding nothing.", "kv_pages_free"),
    ("prefix_cache_hit_tokens", "Prompt tokens whose KV entries came from the prefix cache (not prefilled), since start.", "prefix_cache_hit_tokens"),
    ("preemptions", "Requests preempted to free KV-cache pages for older ones (resumed later by recomputing their tokens), since start.", "preemptions"),
)


class ServingMetrics:
    """One server's metrics; ``stats`` returns the engine's ``EngineStats`` (or None)."""

    def __init__(self, stats: Callable[[], object | None] = lambda: None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "Requests ended, by finish reason.", ["finish_reason"], registry=r)
        for reason in FinishReason:  # every series exists from the start, at 0
            self.requests.labels(reason.value)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From submit to the first generated token.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between a request's successive tokens.", buckets=ITL_BUCKETS, registry=r)
        r.register(_EngineGauges(stats))

    def finished(self, reason: FinishReason) -> None:
        """Count a request that ended with ``reason``."""
        self.requests.labels(FinishReason(reason).value).inc()

    def timer(self, prompt_tokens: int) -> "RequestTimer":
        """A timer for one request submitted now."""
        return RequestTimer(self, prompt_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request's tokens: the first gives its time to first token (and counts its
    prompt as prefilled), each later one an inter-token gap."""

    def __init__(self, metrics: ServingMetrics, prompt_tokens: int):
        self._metrics = metrics
        self._prompt_tokens = prompt_tokens
        self._last: float | None = None
        self._start = time.perf_counter()

    def token(self) -> None:
        """Record a token delivered now."""
        now = time.perf_counter()
        m = self._metrics
        if self._last is None:
            m.ttft.observe(now - self._start)
            m.prompt_tokens.inc(self._prompt_tokens)
        else:
            m.itl.observe(now - self._last)
        m.generation_tokens.inc()
        self._last = now
