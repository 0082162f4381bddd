"""Serve an artifact over the OpenAI API and query it with the ``openai`` client.

Exports the built-in toy Llama (batch sizes 1 and 4, a byte tokenizer) unless an artifact is
given, starts ``sharktank serve`` on 127.0.0.1 with a free port and an API key, waits for it to
say it is ready, sends a completion and a streamed completion with the real ``openai`` client,
shows that a wrong key is refused, and stops the server (always, also on error).

    pip install 'sharktank[serve]' openai
    python examples/serve_and_query.py [ARTIFACT_DIR]

The toy model's weights are random, so its text is noise; what matters is the round trip.
Exits 1 if an answer is missing or the wrong key is not refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEY = "sk-example-key"
READY_S = 120  # loading and binding; the model is small


def start(artifact: Path) -> tuple[subprocess.Popen, str]:
    """``sharktank serve ARTIFACT`` on a free port; returns the process and its /v1 URL."""
    env = {**os.environ, "SHARKTANK_API_KEY": KEY}  # the key never appears on a command line
    proc = subprocess.Popen([sys.executable, "-m", "sharktank.cli", "serve", str(artifact), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + READY_S
    for line in proc.stdout:  # "serving NAME at http://127.0.0.1:PORT/v1 ..." once ready
        m = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        if m:
            return proc, m[1]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"sharktank serve did not become ready (exit status {proc.wait()})")


def main(argv: list[str] | None = None) -> int:
    import openai

    with tempfile.TemporaryDirectory() as tmp:
        if argv:
            artifact = Path(argv[0])
        else:
            artifact = Path(tmp) / "toy"
            subprocess.run([sys.executable, "-m", "sharktank.cli", "export", "--model", "toy-llama", "--batch-sizes", "1,4",
                            "--max-seq-len", "64", "--output-dir", str(artifact), "--json"], check=True, stdout=subprocess.DEVNULL)
        proc, url = start(artifact)
        try:
            client = openai.OpenAI(base_url=url, api_key=KEY, timeout=60)
            model = client.models.list().data[0].id
            done = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
            print(f"{url}: {model!r} answered {done.choices[0].text!r} ({done.usage.completion_tokens} tokens, {done.choices[0].finish_reason})")
            pieces = [c.choices[0].text for c in client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0, stream=True) if c.choices]
            print(f"streamed in {len(pieces)} chunks: {''.join(pieces)!r}")
            try:
                openai.OpenAI(base_url=url, api_key="wrong", timeout=60, max_retries=0).models.list()
                refused = False
            except openai.AuthenticationError:
                refused = True
            print("a wrong key is refused (401):", refused)
            return 0 if done.choices[0].text and "".join(pieces) == done.choices[0].text and refused else 1
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
