"""A prefill attends over the prompt's own cache entries only (the ``window``), so what the
cache holds past the prompt is never read: NaNs there leave the logits equal to a fresh
cache's, and the eager model refuses positions past the window. ``keep`` picks the positions
whose logits a forward returns."""

from __future__ import annotations

import pytest
import torch

from sharktank.models import load_model
from sharktank.types import ShardedTensor

PROMPT = torch.tensor([[5, 17, 42, 3, 9, 60, 1, 33]])


def _poison(cache, start: int):
    """Every cache entry from position ``start`` on set to NaN (shards alike)."""
    def nan_from(t):
        t = t.clone()
        t[:, start:] = float("nan")
        return t

    for m, entries in enumerate(cache.entries):
        cache.entries[m] = [
            tuple(type(c)(ts=[nan_from(s) for s in c.shards], devices=c.devices, pinned=c.pinned, **({"shard_dim": c.shard_dim} if hasattr(c, "shard_dim") else {}))
                  if isinstance(c, ShardedTensor) else nan_from(c) for c in kv)
            for kv in entries
        ]


@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_never_reads_the_cache_past_the_prompt(tp):
    model = load_model("toy-llama", tp=tp)
    fresh = model.prefill(PROMPT, model.new_cache(1, 64))
    poisoned = model.new_cache(1, 64)
    _poison(poisoned, PROMPT.shape[1])
    got = model.prefill(PROMPT, poisoned)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fresh, rtol=0, atol=0)
    # Without the window the same poisoned cache is read (NaN * 0 is NaN): the test can fail.
    again = model.new_cache(1, 64)
    _poison(again, PROMPT.shape[1])
    positions = torch.arange(PROMPT.shape[1])[None, :]
    assert torch.isnan(model.forward(PROMPT, positions, again)).any()


def test_forward_refuses_positions_past_the_window():
    model = load_model("toy-llama")
    with pytest.raises(ValueError, match="past the attended window of 4 cache entries"):
        model.forward(PROMPT[:, :4], torch.arange(2, 6)[None, :], model.new_cache(1, 16), window=4)


@pytest.mark.parametrize("kwargs", [{}, {"tp": 2}, {"pp": 2}])
def test_keep_gives_those_positions_logits(kwargs):
    """``keep``: each row's chosen positions' logits ``[B, K, vocab]`` (the head runs for those
    positions only), equal to the same positions of the whole forward's."""
    model = load_model("toy-llama", **kwargs)
    tokens = torch.cat([PROMPT, PROMPT.flip(1)])
    positions = torch.arange(8)[None].expand(2, -1)
    every = model.forward(tokens, positions, model.new_cache(2, 16), window=8)
    keep = torch.tensor([[7, 0], [2, 5]])
    got = model.forward(tokens, positions, model.new_cache(2, 16), window=8, keep=keep)
    assert got.shape == (2, 2, model.config.vocab_size)
    torch.testing.assert_close(got, torch.take_along_dim(every, keep[:, :, None], 1), rtol=0, atol=1e-5)


def test_forward_refuses_keep_outside_the_tokens():
    model = load_model("toy-llama")
    with pytest.raises(ValueError, match=r"keep must be int64 \[B, K\] = \[1, K\] indices in \[0, 8\), found torch.int64 \[1, 1\] in 8..8"):
        model.forward(PROMPT, torch.arange(8)[None], model.new_cache(1, 16), window=8, keep=torch.tensor([[8]]))
