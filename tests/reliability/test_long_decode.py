"""Long runs of the compiled toy model: the same tokens as eager torch and flat memory.

CI decodes 64 steps; the soak (SHARKTANK_SOAK=1) 1,000 on an artifact exported with a
1,040-long cache. RSS comes from /proc/self/statm and is sampled through a plain decode loop
(only the token ids are kept, so any growth is the runtime's, not the results').
"""

from __future__ import annotations

import torch

from reltools import build_once, build_toy, rss_bytes, shared_dir, soak
from sharktank.models import load_model
from sharktank.runtime import CompiledModel

PROMPT = torch.tensor([[5, 17, 42, 3, 9, 60, 1, 33]])
MB = 1 << 20


def decode_loop(m: CompiledModel, prompt: torch.Tensor, steps: int, warmup: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Greedy ids for ``steps`` tokens and (step, RSS) samples taken from step ``warmup`` on."""
    logits, cache = m.prefill(prompt)
    nxt = logits[:, -1].argmax(-1)
    ids = [int(nxt)]
    pos = prompt.shape[1]
    samples = []
    every = max(1, (steps - warmup) // 10)
    for step in range(1, steps):
        logits, cache = m.decode(nxt, cache, torch.tensor([pos]))
        nxt = logits[:, -1].argmax(-1)
        ids.append(int(nxt))
        pos += 1
        if step >= warmup and (step - warmup) % every == 0 or step == steps - 1:
            samples.append((step, rss_bytes()))
    return torch.tensor([ids]), samples


def _growth(samples) -> int:
    return samples[-1][1] - samples[0][1]


def _describe(steps: int, samples) -> str:
    first, last = samples[0], samples[-1]
    peak = max(r for _, r in samples)
    return (f"{steps} decode steps: RSS {first[1] / MB:.1f} MB at step {first[0]} -> {last[1] / MB:.1f} MB at step {last[0]} "
            f"(growth {_growth(samples) / 1024:+.0f} KiB, peak {peak / MB:.1f} MB)")


def test_64_decode_steps_match_eager_with_flat_memory(toy_artifact, figure):
    m = CompiledModel(toy_artifact)
    eager = load_model("toy-llama").generate(PROMPT, 64)
    decode_loop(m, PROMPT, 16, 0)  # warm the allocator and the runtime's caches
    ids, samples = decode_loop(m, PROMPT, 64, 8)
    assert torch.equal(ids, eager), f"first difference at step {int((ids != eager).nonzero()[0, 1])}"
    assert torch.equal(m.generate(PROMPT, 64)[0], eager)
    figure("RSS (CI)", _describe(64, samples))
    assert _growth(samples) < 2 * MB, _describe(64, samples)


@soak
def test_1000_decode_steps_match_eager_with_flat_memory(tmp_path_factory, figure):
    steps = 1000
    art = build_once(shared_dir(tmp_path_factory), "toy-1040", lambda out: build_toy(out, 1040))
    m = CompiledModel(art)
    eager = load_model("toy-llama").generate(PROMPT, steps)
    decode_loop(m, PROMPT, 32, 0)
    ids, samples = decode_loop(m, PROMPT, steps, 100)
    assert torch.equal(ids, eager), f"first difference at step {int((ids != eager).nonzero()[0, 1])}"
    figure("RSS (soak)", _describe(steps, samples))
    print(_describe(steps, samples), [(s, round(r / MB, 2)) for s, r in samples])
    assert _growth(samples) < 4 * MB, _describe(steps, samples)
    ids2, logits = m.generate(PROMPT, steps)
    assert torch.equal(ids2, eager) and logits.shape == (1, steps, 256)
