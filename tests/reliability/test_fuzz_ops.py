"""Differential fuzzing of sharktank.ops (the runner is in opfuzz.py; its generator, op builders
and checks in opfuzz_gen.py, opfuzz_ops.py and opfuzz_check.py).

CI runs 800 seeded sequences in four chunks (so the xdist workers share them); the soak runs
many more. Every failure the fuzzer found is kept here twice: its seed, and the smallest
direct reproduction (a seed replays only as long as the generator is unchanged)."""

from __future__ import annotations

import os

import pytest
import torch

from opfuzz import run_seeds, run_sequence
from placing import place
from reltools import soak
from sharktank import ops

CHUNKS, PER_CHUNK = 4, 200

# seed -> what it found (fixed in sharktank/ops; see the direct tests below).
REGRESSION_SEEDS = {
    5521: "unreduced - broadcast replicated left stride-0 (expanded) shards; ops.view then raised RuntimeError",
    643: "same bug via a 4-D unreduced value",
    6962: "same bug, reached through a split operand",
}


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_op_sequences_match_torch_or_refuse(chunk, figure):
    stats = run_seeds(range(chunk * PER_CHUNK, (chunk + 1) * PER_CHUNK))
    figure("fuzz (CI)", {"sequences": stats.sequences, "ops": stats.ops, "matched torch": stats.ok, **stats.refused})
    assert not stats.failures, f"{len(stats.failures)} failures; first:\n" + "\n".join(stats.failures[:3])
    assert stats.sequences == PER_CHUNK and stats.ops >= 5 * PER_CHUNK
    # Both outcomes are exercised: most steps compute, and every documented refusal occurs.
    assert stats.ok >= stats.ops // 2
    assert set(stats.refused) == {"PlacementError", "ShardingError", "NoImplementationError"}
    missing = EVERY_OP - set(stats.per_op)
    assert not missing, f"never drawn in {PER_CHUNK} sequences: {sorted(missing)}"


EVERY_OP = {
    "add", "sub", "mul", "div", "elementwise", "matmul", "linear", "reshape", "view", "flatten", "unflatten", "transpose",
    "permute", "expand", "sum", "mean", "softmax", "rms_norm", "layer_norm", "cat", "index_select", "argmax", "all_gather",
    "all_reduce", "reduce_scatter", "reshard_split", "reshard", "replicate", "unshard", "transfer", "to",
}


@pytest.mark.parametrize("seed", sorted(REGRESSION_SEEDS))
def test_regression_seed(seed):
    out = run_sequence(seed)
    assert out.ops and not out.failures, out.failures


def test_unreduced_minus_broadcast_replicated_can_be_viewed():
    # Seed 5521: u - r with r broadcasting u's [6, 6] to [2, 6, 6] gave shards 1.. as expand()
    # views (stride 0), and ops.view of the result raised RuntimeError although torch's view of
    # the same value works.
    gen = torch.Generator().manual_seed(0)
    u_val, r_val = torch.randn(6, 6, generator=gen), torch.randn(2, 6, 6, generator=gen)
    devices = (0, 8, 4, 12, 2, 13, 9)
    u = place(u_val, "P", devices, pinned=True, gen=gen)
    r = place(r_val, "R", devices)
    got = ops.view(ops.sub(u, r), [72])
    torch.testing.assert_close(ops.unshard(got), (u_val - r_val).view(72), atol=1e-5, rtol=1e-5)
    got = ops.view(ops.add(r, u), [12, 6])
    torch.testing.assert_close(ops.unshard(got), (r_val + u_val).view(12, 6), atol=1e-5, rtol=1e-5)


@soak
def test_fuzz_soak(figure):
    n = int(os.environ.get("SHARKTANK_SOAK_FUZZ", "10000"))
    stats = run_seeds(range(100_000, 100_000 + n))
    figure("fuzz (soak)", {"sequences": stats.sequences, "ops": stats.ops, "matched torch": stats.ok, **stats.refused})
    print(stats.summary())
    assert not stats.failures, f"{len(stats.failures)} failures; first:\n" + "\n".join(stats.failures[:5])
