"""The serving engine over a compiled mixture of experts (tp2 x ep2: whole experts per
device): requests run together in a batch, their rows routed to different experts, each
equal to its greedy ids alone."""

from __future__ import annotations

import threading

import torch

from test_moe_reference import hf_moe
from sharktank import ops
from sharktank.export.artifact import export_artifact
from sharktank.layers import route
from sharktank.models import load_model
from sharktank.runtime import CompiledModel
from sharktank.serving.engine import Engine
from sharktank.text.sampling import SamplingParams

PROMPTS = [[(11 * i + 5 * j + 2) % 64 for j in range(4 + 3 * i)] for i in range(6)]


def test_concurrent_requests_on_an_expert_parallel_model_match_each_alone(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    hf_moe("mixtral").save_pretrained(ckpt)
    out = tmp_path / "art"
    export_artifact(load_model(ckpt, tp=2, ep=2, deferred=True), out, source=str(ckpt), batch_sizes=(1, 4), max_seq_len=32,
                    functions=("prefill", "decode", "prefill_row"))
    compiled = CompiledModel(out, driver="local-sync")
    lengths = [4 + i % 3 for i in range(len(PROMPTS))]
    want = [compiled.generate(torch.tensor([p]), n)[0][0].tolist() for p, n in zip(PROMPTS, lengths)]

    # The requests' rows are routed to different experts: the first block's choices for each
    # prompt's last token, recorded from the eager model.
    import sharktank.layers.moe as moe

    seen = []

    def recording(logits, *args, **kwargs):
        weights, experts = route(logits, *args, **kwargs)
        seen.append(experts)
        return weights, experts

    model = load_model(ckpt)
    firsts = set()
    monkeypatch.setattr(moe, "route", recording)
    for p in PROMPTS:
        seen.clear()
        model.prefill(torch.tensor([p]))
        firsts.add(tuple(sorted(ops.unshard(seen[0])[-1].tolist())))
    monkeypatch.undo()
    assert len(firsts) >= 3, firsts

    engine = Engine(compiled, paged=False)
    assert engine.batch_size == 4
    engine.start()
    try:
        done = [threading.Event() for _ in PROMPTS]
        got: list[list[int]] = [[] for _ in PROMPTS]

        def collect(i):
            def on_event(e):
                if e.token is not None:
                    got[i].append(e.token)
                if e.finish_reason is not None:
                    done[i].set()
            return on_event

        for i, (p, n) in enumerate(zip(PROMPTS, lengths)):  # 6 requests for 4 rows
            engine.submit(p, SamplingParams(max_tokens=n), collect(i))
        for d in done:
            assert d.wait(60)
    finally:
        engine.stop()
    assert got == want
