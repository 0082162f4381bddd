"""Run a pipeline split over two hosts, both on this machine, with torchrun (gloo on 127.0.0.1),
and check it against the same model as one program.

Exports the built-in toy Llama as 2 pipeline stages twice: as one program (2 devices) and with
``--hosts 2`` (one program per host in ``DIR/host_0`` and ``DIR/host_1``). Then starts one torchrun
per "host", as two real hosts would (``--nnodes 2 --node-rank r``), each running
``sharktank run DIR --tokens ...``; rank 0 prints the result. On real hosts, copy
``DIR/manifest.json`` and ``DIR/host_r/`` to host r and put its address in ``--master-addr``.

    python examples/two_hosts_one_machine.py

Exits 1 if the two-host ids differ from the one-program ids. Every process is bounded by a
timeout and killed if it outlives it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TOKENS = ["--tokens", "1,2,3,4", "--max-new-tokens", "6", "--json"]
LIMIT_S = 180


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "sharktank.cli", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        one, two = Path(tmp) / "one", Path(tmp) / "two"
        # The one-host program gets the two functions `run` calls (a program per host has no others).
        for out, extra in ((one, ["--functions", "prefill,decode"]), (two, ["--hosts", "2"])):
            subprocess.run(cli("export", "--model", "toy-llama", "--pp", "2", "--max-seq-len", "32", *extra, "--output-dir", str(out), "--json"),
                           check=True, stdout=subprocess.DEVNULL, timeout=LIMIT_S)
        want = json.loads(subprocess.run(cli("run", str(one), *TOKENS), check=True, capture_output=True, text=True, timeout=LIMIT_S).stdout)
        port = str(free_port())
        ranks = [
            subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                              "--master-addr", "127.0.0.1", "--master-port", port, "-m", "sharktank.cli", "run", str(two), *TOKENS, "--timeout", "60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in (0, 1)
        ]
        try:
            outs = [p.communicate(timeout=LIMIT_S) for p in ranks]
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in ranks):
            print("a rank failed:", *(err[-1500:] for _, err in outs), sep="\n")
            return 1
        got = json.loads(outs[0][0].strip().splitlines()[-1])
        print("one program: ", want["ids"])
        print("two hosts:   ", got["ids"], f"({got['hosts']} hosts; bytes each rank sent per decode token: {got['bytes_per_decode_token']})")
        return 0 if got["ids"] == want["ids"] else 1


if __name__ == "__main__":
    sys.exit(main())
