"""A Mixtral checkpoint exported, compiled for the CPU and run, on one host and over two: its
logits and greedy ids equal the eager model's, its decode program reads only the routed
experts (in place, through the CPU kernels' stacked form) and its prefill runs each expert
over only its own tokens (read in the IR)."""

from __future__ import annotations

import re

import torch

from test_moe_reference import TOKENS, hf_moe
from sharktank import ops
from sharktank.export.artifact import export_artifact
from sharktank.models import load_model
from sharktank.runtime import CompiledModel


def _function(mlir: str, name: str) -> str:
    """The text of ``func.func @name`` up to the next function."""
    start = mlir.index(f"func.func @{name}(")
    end = mlir.find("func.func @", start + 1)
    return mlir[start : end if end >= 0 else len(mlir)]


def test_compiled_mixtral_equals_eager(tmp_path):
    ckpt = tmp_path / "ckpt"
    hf_moe("mixtral").save_pretrained(ckpt)
    out = tmp_path / "art"
    export_artifact(load_model(ckpt, deferred=True), out, source=str(ckpt), max_seq_len=32, functions=("prefill", "decode"))
    mlir = (out / "model.mlir").read_text()
    # Decode (one token, k=2 of E=4) reads the two chosen experts of every stacked weight in
    # place: the float32 kernel's stacked form takes every expert's weight and each pair's
    # index, both pairs in one call (no slice, no gather, no index read back); prefill groups
    # the tokens by expert: each expert runs over its own run of tokens (a narrow of
    # data-dependent size per expert and block), and no product spans all experts.
    decode, prefill = _function(mlir, "decode_bs1"), _function(mlir, "prefill_bs1")
    calls = re.findall(r"util\.call @(sharktank_f32_product_e4\w+)\(", decode)
    assert len(calls) == 3 * 2  # gate, up and down, both blocks
    assert set(calls) == {"sharktank_f32_product_e4p2_1x128x64_f32", "sharktank_f32_product_e4p2_1x64x128_f32"}
    assert not re.search(r"torch\.aten\.narrow %\S+, %int0\S*, %\S+, %int1\S* : !torch\.vtensor<\[4,", decode)
    assert "torch.aten.item" not in decode
    assert not re.search(r"index_select %\S+, %\S+, %\S+ : !torch\.vtensor<\[4,", decode + prefill)
    runs = re.compile(r"torch\.aten\.narrow %\S+, %\S+, %\S+, %\S+ : !torch\.vtensor<\[\?,\d+\],f32>")
    assert len(runs.findall(prefill)) == 2 * 4
    assert not re.search(r"vtensor<\[4,\?,", prefill)

    compiled, model = CompiledModel(out), load_model(ckpt)
    prompt = TOKENS[:1, :12]
    short = TOKENS[:1, :2]  # 4 pairs over 4 experts: runs of zero tokens are likely
    got, _ = compiled.prefill(short)
    want = model.prefill(short)
    assert ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item() <= 1e-5
    got, _ = compiled.prefill(prompt)
    want = model.prefill(prompt)
    err = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    assert err <= 1e-5, f"prefill: max |error| / max |logit| = {err:.3g}"
    ids, steps = compiled.generate(prompt[:, :6], 6)
    assert torch.equal(ids, model.generate(prompt[:, :6], 6))
    want = model.prefill(torch.cat([prompt[:, :6], ids[:, :-1]], 1))[:, 5:]
    err = ((steps - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    assert err <= 1e-5, f"decode: max |error| / max |logit| = {err:.3g}"


def test_expert_parallel_export_from_the_command_line(tmp_path, capsys):
    """`export --ep 2 --pp 2` (tp 1: expert parallelism alone): each stage on two devices that
    hold whole experts and replicate the rest, compiled; the program's one collective per
    block is the experts' combine; `run --compare-eager` rebuilds the eager model with the
    same split from the manifest; a batch of 4 (8 pairs over each device's 2 experts: every
    local expert run, weighted) equals eager; inspect says how experts are placed. (The
    two-host test below compiles tp = ep, attention split over the experts' devices.)"""
    import json

    from sharktank.cli import main

    ckpt = tmp_path / "ckpt"
    hf_moe("mixtral").save_pretrained(ckpt)
    out = tmp_path / "art"
    capsys.readouterr()
    argv = ["--ep", "2", "--pp", "2", "--batch-sizes", "1,4", "--functions", "prefill,decode"]
    assert main(["export", "--model", str(ckpt), *argv, "--max-seq-len", "32", "--output-dir", str(out), "--json"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["model"]["experts"], manifest["model"]["dense"], manifest["parallel"]["replicas"]) == ("experts", "replicated", [[[0, 1]], [[2, 3]]])
    # Per decode step: each block's all-reduce over its two devices (2 transfers, 2 blocks),
    # the residual stream into stage 1 (one copy per device: 2), the token and position to
    # device 1 (2) and the position to stage 1's devices (2). Eager records the same.
    model = load_model(ckpt, ep=2, pp=2)
    cache = model.new_cache(1, 8)
    model.prefill(TOKENS[:1, :3], cache)
    with ops.record_transfers() as log:
        model.decode(TOKENS[0, 3:4], cache, torch.tensor([3]))
    assert manifest["transfers"]["decode_bs1"] == len(log) == 2 * 2 + 2 + 2 + 2
    assert main(["run", str(out), "--tokens", "3,1,4,1,5", "--max-new-tokens", "4", "--compare-eager", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert ran["eager_ids_match"] and ran["max_abs_error_vs_eager"] < 1e-4
    prompt = TOKENS[:, :14].reshape(4, 7)
    ids, steps = CompiledModel(out).generate(prompt, 5)
    assert torch.equal(ids, model.generate(prompt, 5))
    want = model.prefill(torch.cat([prompt, ids[:, :-1]], 1))[:, 6:]
    assert ((steps - want).abs().amax(-1) / want.abs().amax(-1)).max().item() <= 1e-5
    assert main(["inspect", str(out)]) == 0
    assert "experts: 4 per block, 2 per token; whole experts per device (expert parallelism alone" in capsys.readouterr().out


def test_expert_parallel_stages_over_two_hosts_equal_eager(tmp_path):
    """`export --tp 2 --ep 2 --pp 2 --hosts 2`: one stage per host, its attention split and its
    experts whole over the host's two devices; two ranks (gloo on 127.0.0.1, every process
    bounded and stopped) generate the eager model's ids, and rank 0's logits are within
    float32 summation order of eager's."""
    import json
    import os
    import socket
    import subprocess
    import sys

    import numpy as np

    from sharktank.cli import main

    ckpt = tmp_path / "ckpt"
    hf_moe("mixtral").save_pretrained(ckpt)
    out = tmp_path / "art"
    argv = ["--tp", "2", "--ep", "2", "--pp", "2", "--hosts", "2", "--max-seq-len", "32"]
    assert main(["export", "--model", str(ckpt), *argv, "--output-dir", str(out)]) == 0
    hosts = json.loads((out / "manifest.json").read_text())["hosts"]
    assert [(h["stages"], h["devices"]) for h in hosts] == [([0], [[0, 0], [1, 1]]), ([1], [[2, 0], [3, 1]])]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tokens = [3, 1, 4, 1, 5]
    run = [sys.executable, "-m", "sharktank.cli", "run", str(out), "--tokens", ",".join(map(str, tokens)), "--max-new-tokens", "5",
           "--save-logits", str(tmp_path / "hosts.npy"), "--json", "--timeout", "30"]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen(run, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        results = [(p.communicate(timeout=120), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [rc for _, rc in results] == [0, 0], [err[-2000:] for (_, err), _ in results]
    got = json.loads(results[0][0][0].strip().splitlines()[-1])
    model = load_model(ckpt, tp=2, ep=2, pp=2)
    prompt = torch.tensor([tokens])
    ids = model.generate(prompt, 5)
    assert got["hosts"] == 2 and got["ids"] == ids[0].tolist()
    want = model.prefill(torch.cat([prompt, ids[:, :-1]], 1))[:, len(tokens) - 1 :]
    logits = torch.from_numpy(np.load(tmp_path / "hosts.npy"))
    assert logits.shape == want.shape
    assert ((logits - want).abs().amax(-1) / want.abs().amax(-1)).max().item() <= 1e-5
