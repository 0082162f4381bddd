"""`serve` over a compiled mixture of experts (expert parallelism alone: ep 2, whole experts
per device, attention and a paged KV cache replicated on both): concurrent HTTP requests
through the real openai client, on 127.0.0.1, run together in a batch with their rows
routed to different experts, each equal to its greedy ids run alone."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from test_moe_reference import hf_moe
from sharktank import ops
from sharktank.export.artifact import export_artifact
from sharktank.layers import route
from sharktank.models import load_model
from sharktank.runtime import CompiledModel
from sharktank.serving.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
openai = pytest.importorskip("openai")
from live import LiveServer  # noqa: E402

from sharktank.serving.server import create_app  # noqa: E402
from sharktank.text.tokenizer import ByteTokenizer  # noqa: E402

PROMPTS = [[(11 * i + 5 * j + 2) % 64 for j in range(4 + 3 * i)] for i in range(6)]


def test_concurrent_requests_on_an_expert_parallel_model_match_each_alone(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    hf_moe("mixtral").save_pretrained(ckpt)
    out = tmp_path / "art"
    export_artifact(load_model(ckpt, ep=2, deferred=True), out, source=str(ckpt), batch_sizes=(1, 4), max_seq_len=32,
                    functions=("prefill", "decode"), page_size=4)
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

    engine = Engine(compiled)
    assert engine.batch_size == 4 and engine.page_size == 4  # the paged pool, replicated on the experts' devices
    with LiveServer(create_app(engine, ByteTokenizer(), "moe")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60, max_retries=0)

        def ask(i):
            r = client.completions.create(model="moe", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                          extra_body={"return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 6 requests for 4 rows
            got = list(pool.map(ask, range(len(PROMPTS))))
        assert client.models.list().data[0].id == "moe"  # the server still answers after the batch
    assert got == want
