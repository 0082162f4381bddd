"""`sharktank serve` of a multi-host artifact (tp2×pp2 over 2 hosts), live on 127.0.0.1: rank 0
serves HTTP and runs the engine, rank 1 runs its calls over gloo.

Greedy answers are compared with the one-host artifact's engine on the same prompts (never
stored values). Every rank is a subprocess with its output in files, killed at the end of its
test whatever happened; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from runtime.hosts_artifacts import hosts_artifacts  # noqa: E402

from sharktank.runtime import CompiledModel  # noqa: E402
from sharktank.runtime.distributed import HEARTBEAT_S  # noqa: E402
from sharktank.serving.engine import Engine  # noqa: E402
from sharktank.text import SamplingParams, load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "toy"
LIMIT_S = 90  # no rank outlives its test by more than this
REQUEST_S = 30
# A lost rank or a stopped rank 0 ends every rank within this (measured: ~1-3 s; the CLI's
# shutdown grace for open requests is 5 s).
EXIT_BOUND_S = 12
# Under torchrun each node's agent also waits for the other agents in its exit barrier (and
# node 0's for its worker, up to torchrun's own 30 s): a looser bound on whole nodes.
TORCHRUN_EXIT_S = 45
PROMPTS = [("Hello", 12), ("The quick brown", 9), ("ab", 14), ("multi-host serving", 6)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    return hosts_artifacts(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(hosts):
    """``prompt -> ids``: greedy ids of the one-host artifact's engine (batch 4, as served)."""
    tokenizer = load_tokenizer(hosts["single"])
    engine = Engine(CompiledModel(hosts["single"]), batch_size=4)
    engine.start()
    try:
        want = {}
        for prompt, n in PROMPTS:
            done, ids = threading.Event(), []
            params = SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=tuple(tokenizer.eos_token_ids))
            engine.submit(tokenizer.encode(prompt), params, lambda e: (e.token is not None and ids.append(e.token), e.finish_reason and done.set()))
            assert done.wait(REQUEST_S)
            want[prompt] = ids
        return want
    finally:
        engine.stop()


class Ranks:
    """The rank processes of one 2-host serve; ``url`` is rank 0's API."""

    def __init__(self, procs: list[subprocess.Popen], logs: list[Path], url: str):
        self.procs, self.logs, self.url = procs, logs, url

    def err(self, r: int) -> str:
        return self.logs[r].read_text(errors="replace")

    def wait(self, r: int, timeout: float) -> tuple[int, float]:
        """``(exit status, when)`` of rank ``r``'s process, within ``timeout`` seconds."""
        rc = self.procs[r].wait(timeout=timeout)
        return rc, time.monotonic()


@contextlib.contextmanager
def serving(artifact: Path, tmp: Path, *, torchrun: bool = False, follower: list[str] | None = None, timeout: float = 20):
    """Start rank 1 then rank 0 of `sharktank serve artifact` and wait for /health 200.
    ``torchrun``: each rank under its own torchrun agent (--nnodes 2 --node-rank r), as on
    two hosts; else RANK/WORLD_SIZE/MASTER_* as torchrun sets them, and ``follower``: rank
    1's command instead of `python -m sharktank.cli`. Every process is killed on the way out."""
    master, http = _free_port(), _free_port()
    args = ["serve", str(artifact), "--timeout", str(timeout), "--model-name", MODEL]
    procs, logs = [], []
    try:
        for r in (1, 0):
            rank_args = [*args, *(["--port", str(http)] if r == 0 else [])]
            env = dict(os.environ)
            if torchrun:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                       "--master-addr", "127.0.0.1", "--master-port", str(master), "-m", "sharktank.cli", *rank_args]
            else:
                main = follower if (r == 1 and follower) else [sys.executable, "-m", "sharktank.cli"]
                cmd = [*main, *rank_args]
                env.update(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
            logs.insert(0, tmp / f"rank{r}.err")
            procs.insert(0, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(logs[0], "w")))
        ranks = Ranks(procs, logs, f"http://127.0.0.1:{http}")
        deadline = time.monotonic() + LIMIT_S
        while True:
            assert all(p.poll() is None for p in procs), f"a rank exited while starting: {[p.returncode for p in procs]}\n{ranks.err(0)[-2000:]}\n{ranks.err(1)[-2000:]}"
            assert time.monotonic() < deadline, "the server did not become healthy"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ranks.url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield ranks
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _complete(url: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_S)


def test_two_hosts_serve_the_one_host_answers_and_stop_together(hosts, reference, tmp_path):
    with serving(hosts["tp2pp2x2"], tmp_path, torchrun=True) as ranks:
        client = openai.OpenAI(base_url=ranks.url + "/v1", api_key="x", timeout=REQUEST_S, max_retries=0)
        prompt, n = PROMPTS[0]
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={"return_token_ids": True})
        assert got.choices[0].model_extra["token_ids"] == reference[prompt]
        ids, streamed = [], client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body={"return_token_ids": True})
        for chunk in streamed:
            ids += chunk.choices[0].model_extra["token_ids"] if chunk.choices else []
        assert ids == reference[prompt]
        # Concurrent requests share the batch rows (prefill_row, then batched decode steps).
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: _complete(ranks.url, *p), PROMPTS))
        assert [a.status_code for a in answers] == [200] * len(PROMPTS), [a.text for a in answers]
        assert {p: a.json()["choices"][0]["token_ids"] for (p, _), a in zip(PROMPTS, answers)} == reference
        # Stopping host A's torchrun (SIGTERM) stops its rank 0, which stops rank 1: rank 1's
        # node exits 0 (it was told to stop, it lost nothing).
        ranks.procs[0].send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rc1, end1 = ranks.wait(1, TORCHRUN_EXIT_S)
        ranks.wait(0, TORCHRUN_EXIT_S)
        assert rc1 == 0, ranks.err(1)[-3000:]
        assert end1 - t0 < TORCHRUN_EXIT_S


_DIE_ON_TRIGGER = (
    "import os, signal, sys; from sharktank.runtime.distributed import HostProgram; from sharktank.cli import main; "
    "call = HostProgram.call\n"
    "def die(self, *a, **k):\n"
    "    if os.path.exists(os.environ['DIE_IF']): os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return call(self, *a, **k)\n"
    "HostProgram.call = die; sys.exit(main(sys.argv[1:]))"
)


def test_a_follower_lost_during_a_request_fails_it_and_rank_0_exits(hosts, reference, tmp_path, monkeypatch):
    trigger = tmp_path / "die"
    monkeypatch.setenv("DIE_IF", str(trigger))
    with serving(hosts["tp2pp2x2"], tmp_path, follower=[sys.executable, "-c", _DIE_ON_TRIGGER]) as ranks:
        prompt, n = PROMPTS[1]
        ok = _complete(ranks.url, prompt, n)
        assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == reference[prompt]
        trigger.touch()  # rank 1 is SIGKILLed in its next call: this request's prefill
        failed = _complete(ranks.url, prompt, n)
        answered = time.monotonic()
        assert failed.status_code == 500, failed.text
        message = failed.json()["error"]["message"]
        assert "the model was lost" in message and "rank 1 closed its connection (exited or crashed)" in message, message
        assert ranks.procs[1].wait(5) == -signal.SIGKILL
        rc0, end0 = ranks.wait(0, EXIT_BOUND_S)
        assert rc0 == 3, ranks.err(0)[-3000:]
        assert end0 - answered < EXIT_BOUND_S
        assert "sharktank serve: error: the model was lost: rank 0: waiting for rank 1 closed its connection" in ranks.err(0)


def test_an_idle_server_notices_a_killed_follower_and_exits(hosts, tmp_path):
    with serving(hosts["tp2pp2x2"], tmp_path) as ranks:
        time.sleep(2 * HEARTBEAT_S)  # idle: only pings cross
        assert httpx.get(ranks.url + "/health", timeout=5).json()["status"] == "ok"
        ranks.procs[1].kill()
        killed = time.monotonic()
        rc0, end0 = ranks.wait(0, EXIT_BOUND_S)
        assert rc0 == 3, ranks.err(0)[-3000:]
        # Noticed by the next ping (within HEARTBEAT_S), then uvicorn stops.
        assert end0 - killed < HEARTBEAT_S + 5, end0 - killed
        assert "rank 1 closed its connection (exited or crashed)" in ranks.err(0), ranks.err(0)[-3000:]
