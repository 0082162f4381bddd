"""A Llama-family causal LM written once with sharktank.ops for every placement.

The forward pass names no devices. Weights are pinned to their stage's device group;
activations are not, so the placement rule moves the residual stream to each block's
weights (``ops.transfer_if_needed`` at the top of a block, a no-op inside a stage) and the
tensor-parallel collectives run inside the layers. A batch is split into microbatches, and
microbatch ``i`` flows through path ``i % len(plan.paths)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import ops
from ...layers import attention, causal_mask, moe_ffn, rope_inv_freq, rotary_angles, rotary_cos, rotary_sin, swiglu_ffn
from ...parallel import ParallelPlan
from ...types import ReplicatedTensor, SplitPrimitiveTensor
from ...weights import Theta, WeightSource
from .config import LlamaConfig
from .sharding import shard_weights

__all__ = ["LlamaModel", "KVCache"]


@dataclass
class KVCache:
    """Per microbatch: its path, its batch rows, and one ``(k, v)`` pair per block, each
    ``[rows, max_seq_len, kv_heads, head_dim]`` split on kv heads over the block's devices
    (replicated on them when the model's dense weights are: expert parallelism alone)."""

    paths: list[int]
    rows: list[tuple[int, int]]
    entries: list[list[tuple]] = field(default_factory=list)

    @property
    def max_seq_len(self) -> int:
        return self.entries[0][0][0].shape[1]


class LlamaModel:
    """``prefill(tokens, cache) -> logits``, ``decode(tokens, cache, positions) -> logits`` and
    greedy ``generate``; plain torch tensors in and out (tokens int64 ``[B, S]``, logits
    ``[B, S, vocab]``)."""

    def __init__(
        self, config: LlamaConfig, theta: Theta, plan: ParallelPlan | None = None, *, source: WeightSource | None = None, experts: str = "ffn",
        dense: str = "split",
    ):
        """``source``: where ``theta``'s bytes come from (``load_model`` passes it); a deferred
        source's placeholders hold no data, so such a model can be exported, not run.
        ``experts``: how a mixture of experts is split over each tensor-parallel group:
        ``"ffn"`` (each expert split as the dense FFN) or ``"experts"`` (expert parallelism
        over the same devices, whole experts per device; exports and compiles like the rest).
        ``dense``: how the other weights are placed on each group: ``"split"`` (tensor
        parallelism) or ``"replicated"`` (with ``experts="experts"``: expert parallelism
        alone, attention whole on every device over a replicated cache; ``sharding``)."""
        self.config = config
        self.source = source if source is not None else WeightSource.of(theta)
        self.plan = plan or ParallelPlan.from_tp_pp(config.num_layers)
        if len(self.plan.stage_of_block) != config.num_layers:
            raise ValueError(f"plan has {len(self.plan.stage_of_block)} blocks, the model {config.num_layers}")
        self.experts = experts
        self.dense = dense
        self.stages = shard_weights(config, theta, self.plan, experts=experts, dense=dense)
        self.dtype = theta["model.embed_tokens.weight"].dtype
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def splits(self) -> dict:
        """What a manifest records of how a mixture of experts is placed (``{}`` for a dense
        model): ``experts`` (``"ffn"`` or ``"experts"``) and, for expert parallelism alone,
        ``dense: "replicated"``."""
        if not self.config.num_experts:
            return {}
        return {"experts": self.experts, **({"dense": self.dense} if self.dense != "split" else {})}

    # --- cache -----------------------------------------------------------------------------
    def new_cache(self, batch: int, max_seq_len: int | None = None, *, placeholder: bool = False) -> KVCache:
        """An empty cache for ``batch`` sequences, one entry per microbatch. ``placeholder``:
        uninitialised memory that is never touched (tracing reads only shapes), not zeros."""
        c = self.config
        t = max_seq_len or c.max_seq_len
        count = min(batch, len(self.plan.paths))
        bounds = torch.tensor_split(torch.arange(batch), count)
        cache = KVCache(paths=[i % len(self.plan.paths) for i in range(count)], rows=[(int(b[0]), len(b)) for b in bounds])
        for path, (_, rows) in zip(cache.paths, cache.rows):
            entries = []
            for stage, r in enumerate(self.plan.paths[path]):
                devices = self.plan.devices(stage, r)
                for _ in self.plan.blocks_of(stage):
                    make = torch.empty if placeholder else torch.zeros
                    shape = (rows, t, c.num_kv_heads, c.head_dim)
                    if self.dense == "replicated":  # a tensor of its own per device (an export traces each as an argument)
                        entries.append(tuple(
                            ReplicatedTensor(ts=[make(shape, dtype=self.dtype) for _ in devices], devices=devices, pinned=True) for _ in range(2)
                        ))
                    else:
                        zeros = make(shape, dtype=self.dtype)
                        entries.append(tuple(SplitPrimitiveTensor(shard_dim=2, ts=zeros, devices=devices, pinned=True) for _ in range(2)))
            cache.entries.append(entries)
        return cache

    def new_pool(self, num_pages: int, page_size: int, *, placeholder: bool = False) -> KVCache:
        """An empty paged cache: a pool of ``num_pages`` pages of ``page_size`` positions per
        block (each block's pair of ``[num_pages, page_size, kv, hd]`` tensors, on its stage's
        devices), for :meth:`forward` with ``pages``. A plan of one microbatch path only."""
        if len(self.plan.paths) != 1:
            raise ValueError(f"a page pool needs a plan of one microbatch path, found {len(self.plan.paths)} (paths {self.plan.paths})")
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1, found {num_pages} and {page_size}")
        return self.new_cache(num_pages, page_size, placeholder=placeholder)

    # --- forward ---------------------------------------------------------------------------
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, window: int | None = None, rows: torch.Tensor | None = None,
        pages: torch.Tensor | None = None, keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` for ``tokens`` at ``positions`` (both ``[B, S]``); writes the
        new keys and values into ``cache`` (its entries are replaced, not mutated).
        ``window``: attend over the first ``window`` cache entries only (every position must be
        below it; :meth:`prefill` passes ``S``); None: the whole cache. ``rows`` (``[B]`` int64):
        the cache row of each input row (e.g. one prompt's chunk into row 3 of a batch-4 cache;
        a cache of one microbatch only); None: input row ``i`` is cache row ``i``. ``pages``
        (``[B, Wp]`` int64): ``cache`` is a pool from :meth:`new_pool` and row ``b`` of the
        input lives in pages ``pages[b]`` (``layers.attention``); it attends over those
        ``Wp * page_size`` entries. ``keep`` (``[B, K]`` int64, indices into ``S``): the logits
        ``[B, K, vocab]`` of those positions only (e.g. each row's last: what generation
        needs); the final norm and LM head compute no others."""
        if self.source.deferred:
            raise RuntimeError(
                f"this model's weights are placeholders (deferred from {self.source.label}): it can be exported, "
                "not run; load it with load_model(..., deferred=False) to run it eagerly"
            )
        if tokens.shape != positions.shape or tokens.ndim != 2:
            raise ValueError(f"tokens {list(tokens.shape)} and positions {list(positions.shape)} must both be [B, S]")
        if int(positions.min()) < 0:  # a negative index would write at the cache's far end
            raise ValueError(f"positions must be >= 0, found {int(positions.min())}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), found {int(tokens.min())}..{int(tokens.max())}")
        if keep is not None and (keep.dtype != torch.int64 or keep.ndim != 2 or keep.shape[0] != tokens.shape[0] or int(keep.min()) < 0 or int(keep.max()) >= tokens.shape[1]):
            found = f"{keep.dtype} {list(keep.shape)}" + (f" in {int(keep.min())}..{int(keep.max())}" if keep.numel() else "")
            raise ValueError(f"keep must be int64 [B, K] = [{tokens.shape[0]}, K] indices in [0, {tokens.shape[1]}), found {found}")
        if pages is not None:
            return self._forward_paged(tokens, positions, cache, pages, keep)
        if int(positions.max()) >= cache.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is past the cache length {cache.max_seq_len}")
        if window is not None and int(positions.max()) >= window:
            raise ValueError(f"position {int(positions.max())} is past the attended window of {window} cache entries")
        if rows is not None:
            batch = sum(n for _, n in cache.rows)
            if len(cache.paths) != 1:
                raise ValueError(f"rows needs a cache of one microbatch, found {len(cache.paths)} (paths {cache.paths})")
            if rows.shape != (tokens.shape[0],) or int(rows.min()) < 0 or int(rows.max()) >= batch:
                raise ValueError(f"rows must be [B] = [{tokens.shape[0]}] cache rows in [0, {batch}), found {rows.tolist()}")
            out, cache.entries[0] = self.forward_path(tokens, positions, cache.entries[0], 0, window=window, rows=rows, keep=keep)
            return out
        logits = []
        for m, (path, (start, rows)) in enumerate(zip(cache.paths, cache.rows)):
            out, cache.entries[m] = self.forward_path(
                tokens[start : start + rows], positions[start : start + rows], cache.entries[m], path, window=window,
                keep=None if keep is None else keep[start : start + rows],
            )
            logits.append(out)
        return torch.cat(logits, dim=0) if len(logits) > 1 else logits[0]

    def _forward_paged(self, tokens, positions, pool: KVCache, pages: torch.Tensor, keep=None) -> torch.Tensor:
        size, count = pool.max_seq_len, sum(n for _, n in pool.rows)
        if len(pool.paths) != 1:
            raise ValueError(f"pages need a pool of one microbatch (new_pool), found {len(pool.paths)}")
        if pages.dtype != torch.int64 or pages.ndim != 2 or pages.shape[0] != tokens.shape[0]:
            raise ValueError(f"pages must be int64 [B, Wp] with B = {tokens.shape[0]}, found {pages.dtype} {list(pages.shape)}")
        if int(pages.min()) < 0 or int(pages.max()) >= count:
            raise ValueError(f"page ids must be in [0, {count}) for a pool of {count} pages, found {int(pages.min())}..{int(pages.max())}")
        if int(positions.max()) >= pages.shape[1] * size:
            raise ValueError(f"position {int(positions.max())} is past {pages.shape[1]} pages of {size} positions")
        out, pool.entries[0] = self.forward_path(tokens, positions, pool.entries[0], pool.paths[0], window=pages.shape[1] * size, pages=pages, keep=keep)
        return out

    def forward_path(
        self, tokens: torch.Tensor, positions: torch.Tensor, entries: list, path: int, stages=None, padding=None, window=None, rows=None, pages=None,
        keep=None,
    ):
        """One microbatch through ``path``: ``(logits, new cache entries)``. ``stages`` replaces
        the model's weights (export passes its module's parameters). ``tokens`` and
        ``positions`` are taken to live on the path's first device and are copied from there
        to every other device that reads them (a few bytes each), so no device reads
        another's memory and a compiler knows where every value lives. ``padding``: ``[B, S]``
        booleans living there too, True at tokens whose keys and values are not written
        (``layers.attention``). ``window``, ``rows``, ``pages`` and ``keep`` (living there
        too): see :meth:`forward` (with ``pages``, ``window`` is their ``Wp * page_size``)."""
        stages = stages or self.stages
        route = self.plan.paths[path]
        home = self.input_device(path)
        x = self.embed(tokens, home, stages[0][route[0]])
        x, new_entries = self.forward_stages(x, positions, home, entries, path, stages, padding=padding, window=window, rows=rows, pages=pages)
        if keep is not None:  # only these positions' logits: the head computes no others
            at = ops.replicate(ReplicatedTensor(ts=[keep[:, :, None]], devices=(home,)), devices=x.devices)
            x = ops.take_along_dim(x, at, 1)
        return self.head(x, stages[-1][route[-1]]), new_entries

    def embed(self, tokens: torch.Tensor, home: int, weights) -> object:
        """The first stage's embedding of ``tokens`` (living on device ``home``), on that
        stage's devices."""
        tokens = ReplicatedTensor(ts=[tokens], devices=(home,))
        return ops.embedding_lookup(ops.replicate(tokens, devices=weights.devices), weights.embed)

    def forward_stages(
        self, x, positions: torch.Tensor, home: int, entries: list, path: int, stages, first: int = 0, padding=None, window=None, rows=None,
        pages=None,
    ):
        """The residual stream ``x`` through the blocks of stages ``first ..
        first + len(stages) - 1`` of ``path`` (``stages[i]``: the replicas of stage
        ``first + i``; ``entries``: the cache entries of exactly those blocks), with
        ``positions`` (and ``padding``, see :meth:`forward_path`) living on device ``home``,
        attending over the first ``window`` cache entries of cache rows ``rows`` (:meth:`forward`):
        ``(x, new cache entries)``."""
        c = self.config
        positions = ReplicatedTensor(ts=[positions], devices=(home,))
        padding = ReplicatedTensor(ts=[padding], devices=(home,)) if padding is not None else None
        rows = ReplicatedTensor(ts=[rows], devices=(home,)) if rows is not None else None
        pages = ReplicatedTensor(ts=[pages], devices=(home,)) if pages is not None else None
        new_entries = []
        block = 0
        # Device group -> positions, rotary cos and sin, causal mask there (once per group).
        per_group: dict[tuple[int, ...], tuple] = {}
        for i, replicas in enumerate(stages):
            weights = replicas[self.plan.paths[path][first + i]]
            if weights.devices not in per_group:
                pos = ops.replicate(positions, devices=weights.devices)
                angles = ops.elementwise(rotary_angles, pos, inv_freq=self.inv_freq)
                cos, sin = (ops.elementwise(f, angles, dtype=self.dtype) for f in (rotary_cos, rotary_sin))
                pad = ops.replicate(padding, devices=weights.devices) if padding is not None else None
                at = ops.replicate(rows, devices=weights.devices) if rows is not None else None
                table = ops.replicate(pages, devices=weights.devices) if pages is not None else None
                length = entries[block][0].shape[1] if window is None else window
                per_group[weights.devices] = (pos, cos, sin, causal_mask(pos, length), pad, at, table)
            pos, cos, sin, mask, pad, at, table = per_group[weights.devices]
            for w in weights.blocks.values():
                # The residual stream follows the block's pinned weights (the placement rule).
                x, _ = ops.transfer_if_needed(x, w["attn_norm"])
                h = ops.rms_norm(x, w["attn_norm"], epsilon=c.rms_norm_eps)
                a, kv = attention(
                    h, w, entries[block], pos, cos, sin,
                    num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, mask=mask, padding=pad,
                    eps=c.rms_norm_eps, window=window, rows=at, pages=table,
                )
                x = ops.add(x, a)
                h = ops.rms_norm(x, w["ffn_norm"], epsilon=c.rms_norm_eps)
                x = ops.add(x, self.ffn(h, w))
                new_entries.append(kv)
                block += 1
        return x, new_entries

    def ffn(self, h, w: dict):
        """The block's feed-forward part of ``h``: a SwiGLU FFN, or a mixture of experts."""
        c = self.config
        if c.is_moe:
            return moe_ffn(
                h, w["router"], w["experts_gate"], w["experts_up"], w["experts_down"],
                top_k=c.num_experts_per_tok, routing=c.family.routing, normalize=c.norm_topk_prob,
            )
        return swiglu_ffn(h, w["gate"], w["up"], w["down"], w.get("gate_bias"), w.get("up_bias"), w.get("down_bias"))

    def head(self, x, weights) -> torch.Tensor:
        """Final norm and LM head (the last stage's ``weights``): logits as one plain tensor."""
        x = ops.rms_norm(x, weights.norm, epsilon=self.config.rms_norm_eps)
        return ops.unshard(ops.linear(x, weights.lm_head))

    def input_device(self, path: int) -> int:
        """The device a microbatch's tokens and positions live on: its path's first device."""
        return self.plan.devices(0, self.plan.paths[path][0])[0]

    # --- public entry points -----------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits for a prompt ``[B, S]`` from position 0 (filling ``cache`` when given)."""
        cache = cache or self.new_cache(tokens.shape[0], max(tokens.shape[1], 1))
        positions = torch.arange(tokens.shape[1])[None, :].expand(tokens.shape[0], -1)
        return self.forward(tokens, positions, cache, window=tokens.shape[1])

    def decode(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` for one new token per sequence (``tokens`` ``[B]`` or
        ``[B, 1]``) at ``positions`` ``[B]``."""
        tokens = tokens.reshape(-1, 1)
        return self.forward(tokens, positions.reshape(-1, 1).to(torch.int64), cache)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: the ``[B, max_new_tokens]`` ids that follow the prompt."""
        b, s = tokens.shape
        cache = self.new_cache(b, s + max_new_tokens)
        logits = self.prefill(tokens, cache)
        out = []
        pos = torch.full((b,), s, dtype=torch.int64)
        for i in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = self.decode(nxt, cache, pos)
                pos = pos + 1
        return torch.stack(out, dim=1) if out else torch.empty(b, 0, dtype=torch.int64)
