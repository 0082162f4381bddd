"""Multi-host artifacts on 127.0.0.1: ranks over gloo give the single-host artifact's results,
each rank reads only its own host's files, and failures end every rank in bounded time with
a message naming the rank."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from runtime.hosts_artifacts import hosts_artifacts

ROOT = Path(__file__).resolve().parents[2]
PROMPT = ["--tokens", "1,2,3,4,5", "--max-new-tokens", "8"]
LIMIT_S = 120  # no process of this module outlives this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "sharktank.cli", *map(str, args)]


def _finish(procs: list[subprocess.Popen], timeout: float = LIMIT_S) -> list[tuple[int, str, str, float]]:
    """Wait for every process (killing all of them past ``timeout``): (rc, stdout, stderr, exit time)."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, timeout))
            out.append((p.returncode, stdout, stderr, time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The same model exported several ways (see hosts_artifacts) and the one-host reference run."""
    dirs = dict(hosts_artifacts(tmp_path_factory))
    logits = tmp_path_factory.mktemp("reference") / "single.npy"
    dirs["want"] = _single_host(dirs["single"], logits)  # the reference run, once
    dirs["want_logits"] = np.load(logits)
    return dirs


def _rank_env(rank: int, world: int, port: int) -> dict:
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _only_own_host(artifact: Path, rank: int, where: Path) -> Path:
    """What host ``rank`` holds of the artifact: the top manifest and its own directory."""
    d = where / f"rank{rank}" / artifact.name
    d.mkdir(parents=True)
    shutil.copy(artifact / "manifest.json", d)
    shutil.copytree(artifact / f"host_{rank}", d / f"host_{rank}")
    return d


def _single_host(directory: Path, logits: Path) -> dict:
    p = subprocess.run(_cli("run", directory, *PROMPT, "--save-logits", logits, "--json"), cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_tp2pp2_over_two_hosts_with_torchrun_matches_the_single_host_artifact(artifacts, tmp_path):
    m = json.loads((artifacts["tp2pp2x2"] / "manifest.json").read_text())
    assert [(h["stages"], h["blocks"], h["devices"]) for h in m["hosts"]] == [([0], [0, 1], [[0, 0], [1, 1]]), ([1], [2, 3], [[2, 0], [3, 1]])]
    from sharktank.weights import irpa_keys

    # Each host's archives hold its own stages' weights only, on devices numbered from 0.
    assert all(".layers.2." not in k and "lm_head" not in k for d in (0, 1) for k in irpa_keys(artifacts["tp2pp2x2"] / "host_0" / f"device_{d}.irpa"))
    assert all("embed_tokens" not in k and ".layers.0." not in k for d in (0, 1) for k in irpa_keys(artifacts["tp2pp2x2"] / "host_1" / f"device_{d}.irpa"))
    want = artifacts["want"]
    port = _free_port()
    run = [*PROMPT, "--save-logits", tmp_path / "hosts.npy", "--json", "--timeout", "30"]
    procs = [
        _start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "sharktank.cli", "run", artifacts["tp2pp2x2"], *map(str, run)], dict(os.environ))
        for r in (0, 1)
    ]
    results = _finish(procs)
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    got = json.loads(results[0][1].strip().splitlines()[-1])
    assert got["ids"] == want["ids"] and got["hosts"] == 2
    # Same stages, same kernels: the boundary carries a copy of the bytes a device would have
    # received on one host, so the logits are bitwise those of the one-host artifact.
    np.testing.assert_array_equal(np.load(tmp_path / "hosts.npy"), artifacts["want_logits"])
    # Per decode token rank 0 sends a 3-int64 header, the hidden state (64 float32) and the
    # position; rank 1 sends the logits (256 float32) back.
    assert got["bytes_per_decode_token"] == {"0": 24 + 64 * 4 + 8, "1": 256 * 4}


def test_run_prompt_over_two_hosts_prints_the_single_host_text(artifacts):
    text = ["--prompt", "Hello there", "--max-new-tokens", "6", "--json"]
    p = subprocess.run(_cli("run", artifacts["single"], *text), cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    want = json.loads(p.stdout)
    port = _free_port()
    procs = [_start(_cli("run", artifacts["tp2pp2x2"], *text, "--timeout", "30"), _rank_env(r, 2, port)) for r in (0, 1)]
    (rc0, out0, err0, _), (rc1, out1, err1, _) = _finish(procs)
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    got = json.loads(out0)
    assert got["hosts"] == 2 and len(got["ids"]) == 6
    assert (got["prompt_ids"], got["ids"], got["text"]) == (want["prompt_ids"], want["ids"], want["text"])
    assert out1 == ""  # rank 1 holds no tokenizer and prints nothing


def test_pp4_over_four_hosts_each_reading_only_its_own_files(artifacts, tmp_path):
    want = artifacts["want"]
    port = _free_port()
    # Each rank gets a directory with the top manifest and its own host's directory only.
    dirs = [_only_own_host(artifacts["pp4x4"], r, tmp_path) for r in range(4)]
    procs = [
        _start(_cli("run", dirs[r], *PROMPT, "--save-logits", tmp_path / "hosts.npy", "--json", "--timeout", "30"), _rank_env(r, 4, port))
        for r in (1, 2, 3, 0)
    ]
    results = _finish(procs)
    assert [r[0] for r in results] == [0, 0, 0, 0], [r[2][-2000:] for r in results]
    got = json.loads(results[-1][1])
    assert got["ids"] == want["ids"] and got["hosts"] == 4 and got["device_count"] == 1
    # One device per stage against tp2 on one host: the o/down projections' sums are added
    # in another order (float32, |logits| < 10: differences of a few 1e-7).
    np.testing.assert_allclose(np.load(tmp_path / "hosts.npy"), artifacts["want_logits"], rtol=0, atol=1e-5)
    assert got["bytes_per_decode_token"] == {"0": 288, "1": 288, "2": 288, "3": 1024}


def test_hosts_named_by_a_placement_file_may_hold_unequal_stages(artifacts, tmp_path):
    # exports/toy-llama-hosts-3-1.toml: stages 0-2 on host 0, stage 3 on host 1, no --hosts.
    m = json.loads((artifacts["tp2pp4x2-uneven"] / "manifest.json").read_text())
    assert m["parallel"]["host_of_stage"] == [0, 0, 0, 1]
    assert [(h["stages"], h["blocks"], h["devices"]) for h in m["hosts"]] == [
        ([0, 1, 2], [0, 1, 2], [[d, d] for d in range(6)]), ([3], [3], [[6, 0], [7, 1]])
    ]
    # inspect draws the whole plan with each stage's host, and each global device holds the
    # weights the same device holds in the one-host artifact.
    inspect = [subprocess.run(_cli("inspect", artifacts[k], *extra), cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S) for k, extra in
               (("tp2pp4x2-uneven", ["--json"]), ("tp2pp4", ["--json"]), ("tp2pp4x2-uneven", []))]
    assert [p.returncode for p in inspect] == [0, 0, 0], [p.stderr[-2000:] for p in inspect]
    hosts, single = json.loads(inspect[0].stdout), json.loads(inspect[1].stdout)
    assert hosts["hosts"] == 2 and hosts["parameter_bytes_per_device"] == single["parameter_bytes_per_device"]
    assert "block 3, host 1" in inspect[2].stdout and "path A: dev 0+1 -> dev 2+3 -> dev 4+5 -> dev 6+7" in inspect[2].stdout
    want = _single_host(artifacts["tp2pp4"], tmp_path / "single.npy")  # the same stages on one host
    assert "host_of_stage" not in json.loads((artifacts["tp2pp4"] / "manifest.json").read_text())["parallel"]
    port = _free_port()
    procs = [_start(_cli("run", artifacts["tp2pp4x2-uneven"], *PROMPT, "--save-logits", tmp_path / "hosts.npy", "--json", "--timeout", "30"), _rank_env(r, 2, port)) for r in (0, 1)]
    results = _finish(procs)
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    got = json.loads(results[0][1])
    assert got["ids"] == want["ids"] and got["hosts"] == 2 and got["device_count"] == 6
    # Same stages, same kernels: bitwise the one-host artifact's logits, as for tp2pp2 above.
    np.testing.assert_array_equal(np.load(tmp_path / "hosts.npy"), np.load(tmp_path / "single.npy"))
    assert got["bytes_per_decode_token"] == {"0": 24 + 64 * 4 + 8, "1": 256 * 4}


_CRASH_ON_THIRD_CALL = (
    "import os, signal, sys; from sharktank.runtime.distributed import HostProgram; from sharktank.cli import main; "
    "call = HostProgram.call; n = [0]\n"
    "def crash(self, *a, **k):\n"
    "    n[0] += 1\n"
    "    if n[0] == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return call(self, *a, **k)\n"
    "HostProgram.call = crash; sys.exit(main(sys.argv[1:]))"
)


def test_a_killed_rank_ends_the_others_naming_it(artifacts):
    port = _free_port()
    art = artifacts["pp4x4"]
    # Rank 2 dies (SIGKILL) in its third step; every other rank exits non-zero soon after.
    procs = {r: _start(_cli("run", art, *PROMPT, "--timeout", "20"), _rank_env(r, 4, port)) for r in (0, 1, 3)}
    procs[2] = _start([sys.executable, "-c", _CRASH_ON_THIRD_CALL, "run", str(art), *PROMPT, "--timeout", "20"], _rank_env(2, 4, port))
    try:
        procs[2].wait(timeout=LIMIT_S)
        died = time.monotonic()
        assert procs[2].returncode == -9
        results = dict(zip((0, 1, 3), _finish([procs[0], procs[1], procs[3]], 60)))
    finally:
        _finish([procs[2]], 1)
    for r, (rc, _, err, ended) in results.items():
        assert rc == 3 and "Traceback" not in err, (r, err[-2000:])
        # Noticed at once (a closed connection), far inside the 20 s bound.
        assert ended - died < 15, (r, ended - died)
    assert "rank 3: waiting for rank 2 closed its connection (exited or crashed)" in results[3][2]
    # Rank 0 names the rank it lost and what that rank reported.
    assert "rank 0: waiting for rank 3 closed its connection" in results[0][2] and "rank 3: waiting for rank 2" in results[0][2], results[0][2]


def test_ranks_that_never_join_are_named_within_the_timeout(artifacts):
    art = artifacts["tp2pp2x2"]
    t0 = time.monotonic()
    alone0 = _start(_cli("run", art, *PROMPT, "--timeout", "3"), _rank_env(0, 2, _free_port()))
    alone1 = _start(_cli("run", art, *PROMPT, "--timeout", "3"), _rank_env(1, 2, _free_port()))
    (rc0, _, err0, end0), (rc1, _, err1, end1) = _finish([alone0, alone1], 60)
    assert rc0 == 3 and "rank 0: rank 1 did not join within 3 s" in err0, err0
    assert rc1 == 3 and "rank 1: cannot reach the rendezvous at 127.0.0.1" in err1, err1
    assert max(end0, end1) - t0 < 40  # loading (imports, module) plus the 3 s bound


def test_wrong_world_size_and_one_host_runs_are_clear_errors(artifacts):
    art = artifacts["tp2pp2x2"]
    p = subprocess.run(_cli("run", art, *PROMPT), cwd=ROOT, env=_rank_env(0, 3, _free_port()), capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 2 and "the artifact runs on 2 hosts, but WORLD_SIZE is 3" in p.stderr, p.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run(_cli("run", art, *PROMPT), cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 2 and "distributed run needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in p.stderr, p.stderr
    p = subprocess.run(_cli("run", art / "host_1", *PROMPT), cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 2 and "host 1's program of a 2-host artifact" in p.stderr, p.stderr
    p = subprocess.run(_cli("run", artifacts["single"], *PROMPT, "--distributed"), cwd=ROOT, env=_rank_env(0, 2, _free_port()), capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 2 and "not a multi-host artifact" in p.stderr, p.stderr


def test_hosts_must_divide_the_stages(tmp_path):
    p = subprocess.run(_cli("export", "--model", "toy-llama", "--pp", "4", "--hosts", "3", "--no-compile", "--output-dir", tmp_path / "x"), cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 2 and "--hosts 3 must divide the pipeline stages (pp=4)" in p.stderr, p.stderr
