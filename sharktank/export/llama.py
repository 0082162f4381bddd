"""Exporting a (sharded) LlamaModel to one multi-device MLIR program.

Functions, for each batch size ``B``:

- ``prefill_bs{B}(tokens[B, S], positions[B, S], *cache) -> (logits[B, S, vocab], *cache)``
  with a dynamic sequence length ``S``: a prompt from position 0 (every position below ``S``),
  attending over the cache's first ``S`` entries only (so its cost does not grow with the
  exported cache length);
- ``decode_bs{B}(tokens[B, 1], positions[B, 1], *cache) -> (logits[B, 1, vocab], *cache)``;
- for ``B > 1``, ``prefill_row_bs{B}(tokens[1, S], positions[1, S], row[1], *cache) ->
  (logits[1, S, vocab], *cache)``: one prompt prefilled into batch row ``row`` of the batch-B
  cache (with one microbatch as a chunk from position 0: the row's entries past the prompt
  keep what they held; with several, zeros), every other row left as it was
  (continuous batching admits a request into a free row this way). For ``B = 1`` it would be
  ``prefill_bs1``, so it is not exported.
- ``prefill_chunk_bs{B}(tokens[1, C], positions[1, C], row[1], span[W], *cache) ->
  (logits[1, C, vocab], *cache)``, for every ``B`` when the cache is one microbatch (one
  path): a chunk of one prompt at positions ``W - C .. W - 1`` written into batch row ``row``,
  attending over that row's first ``W`` entries (the entries earlier chunks or calls wrote, and
  its own). ``span``'s length is ``W`` (the runtime passes ``arange(W)``; its values are not
  read). Chunked prefill and a prompt that continues a row's cached prefix use it; the row's
  other entries and every other row are left as they were.

Logits and cache are in the model's dtype; bfloat16 logits are returned as their int16 bits
(numpy, and so the IREE Python runtime, has no bfloat16), which the runtime reinterprets.

``cache`` is the model's KV cache flattened to one argument per shard (each on the device
that owns its heads and layers). Tokens and positions are plain arguments on the first
device of the first stage. Every weight shard is an external parameter in scope ``model``
named ``{weight}@d{device}``, loaded on its own device, and written to that device's
``device_{d}.irpa``.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .. import ops
from ..models.llama.model import KVCache, LlamaModel
from ..models.llama.sharding import StageWeights
from ..types import QuantizedTensor, ReplicatedTensor
from ..weights import WeightSource
from .kernels import CpuKernels
from .program import arg_devices

__all__ = ["ExportedWeights", "lift_weights", "export_llama", "trace_program", "import_programs", "cache_arg_specs", "row_index", "SCOPE"]

SCOPE = "model"


@dataclass
class ExportedWeights:
    module: torch.nn.Module
    # device -> {external name: the shard it holds}: a view of one of ``source``'s tensors
    # (its bytes are read when the archive is written) or, for shards built by hand, the data.
    archives: dict[int, dict[str, torch.Tensor]]
    source: WeightSource


class _Weights(torch.nn.Module):
    """Every weight shard as a parameter tagged with its device and external name; rebuilds
    the model's stage weights from them inside a traced function.

    Parameters hold no data (uninitialised memory: tracing reads only shapes); the archive
    writer reads each shard's bytes from the model's weight source. A device holds each
    source tensor once: a shard that is a slice of a tensor the device holds whole (the LM
    head tied to the replicated embedding) is that slice of the one parameter, and equal
    views are one parameter."""

    def __init__(self, model: LlamaModel, stages: list[list[StageWeights]] | None = None):
        super().__init__()
        stages = model.stages if stages is None else stages
        self.source = model.source
        self.archives: dict[int, dict[str, torch.Tensor]] = {}
        self._attrs: dict[tuple, str] = {}  # (device, view key) -> parameter attribute
        whole: dict[tuple[int, str], str] = {}  # (device, source name) -> attribute of the whole tensor

        def cut_of(shard, name):
            return _narrowing(shard, self.source.theta[name]) if name is not None else None

        def lift_whole(t):
            for shard, device in zip(t.shards, t.devices):
                name = self.source.locate(shard)
                if cut_of(shard, name) == (None, 0):
                    whole.setdefault((device, name), self._parameter(t.name, shard, device))

        def lift(t):
            refs = []
            for shard, device in zip(t.shards, t.devices):
                name = self.source.locate(shard)
                cut = cut_of(shard, name)
                if cut is not None and (device, name) in whole:
                    dim, start = cut
                    refs.append(whole[(device, name)] if dim is None else (whole[(device, name)], dim, start, shard.shape[dim]))
                else:
                    refs.append(self._parameter(t.name, shard, device))
            return (type(t), getattr(t, "shard_dim", None), t.devices, tuple(refs))

        _map_weights(stages, lift_whole)
        self.recipe = _map_weights(stages, lift)

    def _parameter(self, name: str, shard, device: int):
        """The reference to ``shard``'s parameter: its attribute name, or for a quantized
        shard ``("q", attribute of its blocks, layout, shape, dtype)``."""
        if isinstance(shard, QuantizedTensor):
            return ("q", self._parameter(name, shard.blocks, device), shard.layout.name, tuple(shard.shape), shard.dtype)
        from iree.turbine.aot import DeviceTensorTrait, ExternalTensorTrait

        key = (device, shard.untyped_storage().data_ptr() if shard.numel() else id(shard), shard.storage_offset(), tuple(shard.shape), shard.stride())
        if key in self._attrs:
            return self._attrs[key]
        # A fresh tensor object (traits stick to it); uninitialised: no page of it is touched.
        p = torch.nn.Parameter(torch.empty(shard.shape, dtype=shard.dtype), requires_grad=False)
        external = f"{name}@d{device}"
        DeviceTensorTrait(device).set(p)
        ExternalTensorTrait(external_scope=SCOPE, external_name=external).set(p)
        attr = f"w{len(self._attrs)}"
        self.register_parameter(attr, p)
        self.archives.setdefault(device, {})[external] = shard
        self._attrs[key] = attr
        return attr

    def stages(self) -> list[list[StageWeights]]:
        def shard(ref):
            if isinstance(ref, str):
                return getattr(self, ref)
            if ref[0] == "q":  # blocks stay uint8 parameters; linear dequantizes them
                _, attr, layout, shape, dtype = ref
                return QuantizedTensor(layout, shape, getattr(self, attr), dtype=dtype)
            base, dim, start, length = ref
            return shard(base).narrow(dim, start, length)

        def build(r):
            cls, dim, devices, refs = r
            kwargs = {"shard_dim": dim} if dim is not None else {}
            return cls(ts=[shard(x) for x in refs], devices=devices, pinned=True, **kwargs)

        return _map_weights(self.recipe, build)


def _narrowing(t, base) -> tuple[int | None, int] | None:
    """How ``t`` (a view of ``base``'s storage) cuts ``base``: ``(None, 0)`` for all of it,
    ``(dim, start)`` for ``base.narrow(dim, start, t.shape[dim])``, None for anything else
    (quantized tensors: by their blocks, and only whole ones or rows)."""
    if isinstance(t, QuantizedTensor) or isinstance(base, QuantizedTensor):
        if not (isinstance(t, QuantizedTensor) and isinstance(base, QuantizedTensor)) or t.layout != base.layout:
            return None
        cut = _narrowing(t.blocks, base.blocks)
        return cut if cut is None or cut[0] is None or cut[0] < t.ndim - 1 else None
    if t.dtype != base.dtype or t.ndim != base.ndim or t.stride() != base.stride():
        return None
    offset = t.storage_offset() - base.storage_offset()
    dims = [d for d in range(t.ndim) if t.shape[d] != base.shape[d]]
    if not dims:
        return (None, 0) if offset == 0 else None
    if len(dims) > 1 or offset % base.stride()[dims[0]]:
        return None
    d = dims[0]
    start = offset // base.stride()[d]
    return (d, start) if 0 <= start and start + t.shape[d] <= base.shape[d] else None


def _map_weights(stages: list[list[StageWeights]], fn) -> list[list[StageWeights]]:
    """The same stage structure with ``fn`` applied to every weight that is present."""

    def f(x):
        return None if x is None else fn(x)

    return [
        [
            StageWeights(
                devices=w.devices,
                blocks={b: {k: f(v) for k, v in ws.items()} for b, ws in w.blocks.items()},
                embed=f(w.embed),
                norm=f(w.norm),
                lm_head=f(w.lm_head),
            )
            for w in reps
        ]
        for reps in stages
    ]


def lift_weights(model: LlamaModel, stages: list[list[StageWeights]] | None = None) -> ExportedWeights:
    """Every weight shard of ``model`` (or of just ``stages``, some of its stages) as an
    external parameter of one module."""
    w = _Weights(model, stages)
    return ExportedWeights(w, w.archives, w.source)


@contextlib.contextmanager
def _no_stack_traces():
    import torch.fx

    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _absent_dialect_modules(*names: str):
    """While importing to MLIR, the MLIR Python bindings look for a Python module of each
    dialect they meet (``iree.compiler.dialects.torch``, which iree-base-compiler does not
    ship) and do not remember a miss: every lookup searches ``sys.path`` again, thousands of
    times per program. A ``None`` in ``sys.modules`` makes each miss immediate."""
    import importlib.util

    added = []
    for name in names:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = None
            added.append(name)
    try:
        yield
    finally:
        for name in added:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def _flat_cache(cache: KVCache) -> tuple[list[torch.Tensor], Any, list[int]]:
    leaves, spec = pytree.tree_flatten(cache.entries)
    if len({id(x) for x in leaves}) != len(leaves):
        # Traced as one input, two shards would share one buffer in the program while the
        # runtime passes each device its own: decode would read what another device wrote.
        raise ValueError("the cache's shards must be distinct tensors (a replicated cache needs a tensor per device)")
    devices = arg_devices((cache.entries,))
    return leaves, spec, devices


def trace_program(
    fxb, forward, args: tuple, *, name: str, arg_device: dict, dynamic=None, attention_as_matmuls: bool = False,
    cpu_kernels: CpuKernels | None = None,
) -> None:
    """Trace ``forward`` into ``fxb`` as function ``name``. ``cpu_kernels``: where given, the
    program calls :mod:`sharktank.export.kernels`' CPU dispatches where one applies (a
    CPU-only module: ``export_artifact`` sets it for the ``cpu`` target, see
    :func:`~sharktank.export.kernels.kernels_for`): products with quantized weights, and a
    decode step's attention over the cache or the page pool, and a prompt chunk's over the
    page pool."""
    from iree.turbine.aot.decompositions import extend_aot_decompositions

    products, attention, paged = None, None, None
    if cpu_kernels is not None:
        from .kernels import BlockProducts, decode_attention, paged_attention

        products, attention, paged = BlockProducts(cpu_kernels), decode_attention, paged_attention

    # No extra decompositions: the IREE importer takes these graphs as traced, and
    # turbine's default table re-traces every program (about half the export time).
    # No Python stack trace per graph node either (about 10% of tracing).
    with (
        extend_aot_decompositions(from_current=False),
        _no_stack_traces(),
        ops.attention_as_matmuls(attention_as_matmuls),
        ops.block_kernels(products),
        ops.attention_kernels(attention, paged),
    ):
        fxb.export_program(forward, args=args, dynamic_shapes=dynamic, strict=False, name=name, arg_device=arg_device)


# Range assertions torch.export adds for data-dependent sizes (unbacked symbols, e.g. the
# expert runs of ops.expert_ffn). iree-turbine's importer cannot import their symbolic
# booleans; the sizes are in range by construction, so the assertions are dropped.
_ASSERTIONS = ("_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range")


def _drop_size_assertions(program) -> None:
    graph = program.graph_module.graph
    found = False
    for node in list(graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _ASSERTIONS:
            graph.erase_node(node)
            found = True
    if found:
        graph.eliminate_dead_code()
        program.graph_module.recompile()


def import_programs(fxb):
    """The MLIR module of every function traced into ``fxb``."""
    from iree.turbine import aot

    for target in fxb.programs.values():
        _drop_size_assertions(target.target)

    with _absent_dialect_modules("iree.compiler.dialects.torch", "iree.compiler.dialects.torch_c"):
        return aot.export(fxb)


def cache_arg_specs(leaves: list[torch.Tensor], devices: list[int]) -> list[dict]:
    """The manifest's argument entries of a flattened cache."""
    return [
        {"name": f"cache.{i}", "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."), "device": d}
        for i, (x, d) in enumerate(zip(leaves, devices))
    ]


def _local_row(row: torch.Tensor, *, start: int, n: int) -> torch.Tensor:
    return (row - start).clamp(0, n - 1)


def _holds_row(row: torch.Tensor, *, start: int, n: int) -> torch.Tensor:
    # Clamping leaves it unchanged exactly when it is in range (IREE does not lower `&` of booleans).
    return ((row - start) == _local_row(row, start=start, n=n)).reshape(-1, 1, 1, 1)


def keep_arg(rows: int) -> tuple[str, list]:
    """A prefill function's last index argument, ``keep`` ``[rows, K]`` int64: for each row,
    the positions of its tokens (indices into ``S``) whose logits the call returns
    (``[rows, K, vocab]``). Only those go through the final norm and the LM head, so a caller
    that needs each prompt's last logits (generation, serving) passes ``K = 1`` and skips the
    head's product for every other position (a fifth of a small model's prefill); a
    perplexity run passes every position."""
    return ("keep", [rows, "K"])


def _example(shape: list, seq: int) -> torch.Tensor:
    """An index argument's example while tracing: the window ``W`` a few past the example
    prompt's ``seq``; ``keep``'s ``K`` (3) differs from ``seq``, as its dim is its own."""
    if shape[-1] == "K":
        return torch.tensor([[0, seq // 2, seq - 1]] * shape[0], dtype=torch.int64)
    return torch.zeros([seq + 4 if d == "W" else d for d in shape], dtype=torch.int64)


def logits_out(out: torch.Tensor) -> torch.Tensor:
    """Logits as a function returns them: bfloat16 as its int16 bits (numpy-based runtimes
    cannot read bfloat16), other dtypes as they are."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


def logits_dtype(model: LlamaModel) -> str:
    """The manifest's dtype of the logits :func:`logits_out` returns."""
    return "int16 (bfloat16 bits)" if model.dtype == torch.bfloat16 else str(model.dtype).removeprefix("torch.")


def row_index(row: torch.Tensor, home: int):
    """``devices -> row`` there: the batch row index ``row`` (``[1]`` int64 on device ``home``)
    replicated to each device group that asks, once per group."""
    origin = ReplicatedTensor(ts=[row], devices=(home,))
    at: dict[tuple[int, ...], ReplicatedTensor] = {}

    def row_on(devices):
        if devices not in at:
            at[devices] = ops.replicate(origin, devices=devices)
        return at[devices]

    return row_on


def row_slices(entries: list, index, *, fresh: bool) -> list:
    """Each cache entry's batch row ``index(entry)`` as a ``[1, T, kv, hd]`` slice: its old
    values, or zeros when ``fresh`` (a row prefilled from position 0 in one microbatch, see
    :func:`_prefill_row`; the old row is then not read at all)."""
    rows = [tuple(ops.index_select(c, 0, index(c)) for c in kv) for kv in entries]
    # zeros_like leaves the selection unused, so the compiled call never reads the old row.
    return [tuple(ops.elementwise(torch.zeros_like, c) for c in kv) for kv in rows] if fresh else rows


def _prefill_row(model: LlamaModel, stages, tokens, positions, row, keep, entries: list, paths: list[int], rows: list, first_device: int):
    """``(logits [1, K, vocab], new entries)``: the prompt ``tokens`` prefilled into batch row
    ``row`` (``[1]`` int64 on ``first_device``) of a cache whose microbatches are ``paths``/``rows``.

    Each cache entry's row is a ``[1, T, kv, hd]`` slice (the index replicated to the entry's
    devices) that runs through ``forward_path`` as a batch of one and is written back with
    ``index_put``; no other row is read into or written. With one microbatch the slice starts
    as zeros: a prompt from position 0 attends only to the entries it writes (causal mask), so
    the row's old entries are never needed, and past the prompt the row holds zeros. (Reading
    the old row with ``index_select`` in the call that writes it back aborted in IREE 3.10's
    ``local-task`` driver, ``hal.fence.await``, at 16 layers or more; ``local-sync`` ran it.)

    The row is a runtime value, so with several microbatches the owning one cannot be chosen
    while tracing: each microbatch prefills its clamped local row along its own path (on its
    own devices) from its ``index_select``-ed old slice, writes that back unless it holds the
    row (a ``where``: bit-exact), and the logits (of the positions ``keep``) are those of the owner."""
    row_on = row_index(row, first_device)
    batch = sum(n for _, n in rows)
    logits, new_entries = None, []
    for m, (path, (start, n)) in enumerate(zip(paths, rows)):
        origin = model.input_device(path)
        tok, pos, kept = (tokens, positions, keep) if origin == first_device else (ops.transfer_to_logical_device(a, origin) for a in (tokens, positions, keep))
        whole = n == batch  # one microbatch holds every row: no mask
        local = lambda c: row_on(c.devices) if whole else ops.elementwise(_local_row, row_on(c.devices), start=start, n=n)
        old = row_slices(entries[m], local, fresh=whole)
        out, new = model.forward_path(tok, pos, old, path, stages, window=tokens.shape[1], keep=kept)
        if not whole:
            holds = [ops.elementwise(_holds_row, row_on(kv[0].devices), start=start, n=n) for kv in new]
            new = [tuple(ops.elementwise(torch.where, h, c, o) for c, o in zip(kv, okv)) for kv, okv, h in zip(new, old, holds)]
        new_entries.append([tuple(ops.index_put(c, [local(c)], nc) for c, nc in zip(kv, nkv)) for kv, nkv in zip(entries[m], new)])
        logits = out if logits is None else torch.where(_holds_row(row, start=start, n=n)[:, :, :, 0], out, logits)
    return logits, new_entries


def export_llama(
    model: LlamaModel,
    batch_sizes: tuple[int, ...] = (1,),
    max_seq_len: int | None = None,
    *,
    attention_as_matmuls: bool = False,
    cpu_kernels: CpuKernels | None = None,
    page_size: int | None = None,
    functions: tuple[str, ...] | None = None,
):
    """Trace prefill and decode for each batch size; returns ``(ExportOutput, weights, specs)``
    where ``specs`` describes every function's arguments and results for the manifest.
    ``functions``: the contiguous-cache kinds to trace (see ``export_artifact``; None: every
    kind the plan has).
    ``page_size`` (a plan of one microbatch path): also the paged functions over a pool of
    pages of that many positions (:func:`paged_programs`).
    ``attention_as_matmuls``: trace attention unfused (see :func:`ops.attention_as_matmuls`;
    what ``export_artifact`` does: faster on IREE's CPU backend, and IREE 3.10's GPU backends
    fail to compile the fused op for these models). ``cpu_kernels``: see :func:`trace_program`."""
    from iree.turbine.aot import DeviceAffinity, FxProgramsBuilder

    weights = lift_weights(model)
    fxb = FxProgramsBuilder(weights.module)
    t = max_seq_len or model.config.max_seq_len
    first_device = model.plan.devices(0, model.plan.paths[0][0])[0]
    specs: dict[str, dict] = {}
    logits_type = logits_dtype(model)

    for b in batch_sizes:
        cache = model.new_cache(b, t, placeholder=True)  # a long cache costs no memory here
        leaves, spec, cache_devices = _flat_cache(cache)
        paths, rows = list(cache.paths), list(cache.rows)

        def decode(module, tokens, positions, *cache_leaves):
            return forward_masked(module, tokens, positions, None, None, cache_leaves, window=None)

        def prefill(module, tokens, positions, keep, *cache_leaves):
            return forward_masked(module, tokens, positions, None, keep, cache_leaves, window=tokens.shape[1])

        def prefill_rows(module, tokens, positions, lengths, keep, *cache_leaves):
            return forward_masked(module, tokens, positions, lengths, keep, cache_leaves, window=tokens.shape[1])

        def forward_masked(module, tokens, positions, lengths, keep, cache_leaves, window):
            """prefill or decode; with ``lengths``, prefill_rows (a row's tokens past its length
            are padding). ``window``: the cache entries attended (a prompt's ``S``; decode: all).
            ``keep``: the positions whose logits a prefill returns (:func:`keep_arg`)."""
            entries = pytree.tree_unflatten(list(cache_leaves), spec)
            stages = module.stages()
            logits, new_entries = [], []
            # Padding: a row's tokens from its length on (their cache writes are dropped).
            padding = () if lengths is None else (torch.arange(tokens.shape[1])[None, :] >= lengths[:, None],)
            inputs = {first_device: (tokens, positions, *(() if keep is None else (keep,)), *padding)}  # device -> the whole inputs there
            for m, (path, (start, n)) in enumerate(zip(paths, rows)):
                # Each path takes its rows on its own first device. The whole inputs move
                # there before the slicing: IREE 3.10 cannot partition a transfer of a slice.
                origin = model.input_device(path)
                if origin not in inputs:
                    inputs[origin] = tuple(ops.transfer_to_logical_device(a, origin) for a in inputs[first_device])
                tok, pos, *rest = (a[start : start + n] for a in inputs[origin])
                kept = rest.pop(0) if keep is not None else None
                pad = rest[0] if rest else None
                out, e = model.forward_path(tok, pos, entries[m], path, stages, padding=pad, window=window, keep=kept)
                logits.append(out)
                new_entries.append(e)
            flat_new = pytree.tree_leaves(new_entries)
            return (logits_out(torch.cat(logits, 0) if len(logits) > 1 else logits[0]), *flat_new)

        def prefill_chunk(module, tokens, positions, row, span, keep, *cache_leaves):
            entries = pytree.tree_unflatten(list(cache_leaves), spec)
            out, new = model.forward_path(tokens, positions, entries[0], paths[0], module.stages(), window=span.shape[0], rows=row, keep=keep)
            return (logits_out(out), *pytree.tree_leaves([new]))

        def forward_row(module, tokens, positions, row, keep, *cache_leaves):
            entries = pytree.tree_unflatten(list(cache_leaves), spec)
            if len(paths) == 1:
                # One microbatch: a prompt from position 0 written into row `row` as a chunk is,
                # attending over its own S entries. (The row-slice form below, zeros written
                # back, gave wrong logits in IREE 3.10 for SmolLM2 at 1024 and 2048 entries.)
                out, new = model.forward_path(tokens, positions, entries[0], paths[0], module.stages(), window=tokens.shape[1], rows=row, keep=keep)
                new_entries = [new]
            else:
                out, new_entries = _prefill_row(model, module.stages(), tokens, positions, row, keep, entries, paths, rows, first_device)
            return (logits_out(out), *pytree.tree_leaves(new_entries))

        cache_args = cache_arg_specs(leaves, cache_devices)
        # kind -> (rows of tokens, example length, index arguments, traced function);
        # prefill_row(s)_bs1 would be prefill_bs1: exported only for batches of several rows.
        kinds = {"prefill": (b, 8, (keep_arg(b),), prefill), "decode": (b, 1, (), decode)}
        if b > 1:
            kinds["prefill_row"] = (1, 8, (("row", [1]), keep_arg(1)), forward_row)
            kinds["prefill_rows"] = (b, 8, (("lengths", [b]), keep_arg(b)), prefill_rows)
        if len(paths) == 1:  # a runtime row in one of several microbatches is not built yet
            kinds["prefill_chunk"] = (1, 8, (("row", [1]), ("span", ["W"]), keep_arg(1)), prefill_chunk)
        for kind, (rows_in, seq, extra, fn) in kinds.items():
            if functions is not None and kind not in functions:
                continue
            name = f"{kind}_bs{b}"
            tokens = torch.zeros(rows_in, seq, dtype=torch.int64)
            positions = torch.arange(seq)[None, :].expand(rows_in, seq).clone()
            named = [("tokens", tokens, [rows_in, 1 if kind == "decode" else "S"]), ("positions", positions, [rows_in, 1 if kind == "decode" else "S"])]
            named += [(n, _example(shape, seq), shape) for n, shape in extra]
            args = (*(a for _, a, _ in named), *leaves)
            dynamic = None
            if kind != "decode":
                s = torch.export.Dim("seq_len", min=2, max=t)
                w = torch.export.Dim("window", min=2, max=t)
                k = torch.export.Dim("kept", min=1, max=t)
                extra_dims = [{0: w} if shape == ["W"] else {1: k} if n == "keep" else None for n, shape in extra]
                dynamic = ({1: s}, {1: s}, *extra_dims, tuple([None] * len(leaves)))
            devices = [first_device] * len(named) + cache_devices
            arg_device = {i: DeviceAffinity(d) for i, d in enumerate(devices)}
            trace_program(fxb, fn, args, name=name, arg_device=arg_device, dynamic=dynamic, attention_as_matmuls=attention_as_matmuls, cpu_kernels=cpu_kernels)
            length = 1 if kind == "decode" else "K"
            specs[name] = {
                "batch_size": b,
                "args": [{"name": n, "shape": shape, "dtype": "int64", "device": first_device} for n, _, shape in named] + cache_args,
                "results": [{"name": "logits", "shape": [rows_in, length, model.config.vocab_size], "dtype": logits_type}]
                + [{"name": f"cache.{i}", "same_as_arg": len(named) + i} for i in range(len(leaves))],
                "cache": {"paths": paths, "rows": rows, "max_seq_len": t},
            }
    if page_size is not None:
        specs.update(paged_programs(fxb, model, batch_sizes, t, page_size, attention_as_matmuls=attention_as_matmuls, cpu_kernels=cpu_kernels))
    return import_programs(fxb), weights, specs


def paged_programs(fxb, model: LlamaModel, batch_sizes, max_seq_len: int, page_size: int, **trace) -> dict[str, dict]:
    """Trace the paged functions into ``fxb``; returns their manifest specs. The cache is a
    pool of ``P`` pages of ``page_size`` positions per block (``P`` is chosen when the pool is
    allocated: a dynamic dim), and each call takes its rows' page tables
    (``layers.attention``):

    - ``prefill_paged_bs1(tokens[1, S], positions[1, S], pages[1, Wp], keep[1, K], *pool)``: a
      chunk of one sequence written through its first ``Wp`` pages, attending over them,
      returning the logits of its positions ``keep`` (:func:`keep_arg`);
    - ``decode_paged_bs{B}(tokens[B, 1], positions[B, 1], pages[B, M], *pool)``: one token per
      row over all ``M = ceil(max_seq_len / page_size)`` table entries (the unused ones point
      at any page: the causal mask keeps them unread)."""
    from iree.turbine.aot import DeviceAffinity

    if len(model.plan.paths) != 1:
        raise ValueError(f"paged functions need a plan of one microbatch path, found {len(model.plan.paths)}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, found {page_size}")
    first_device = model.input_device(0)
    most = -(-max_seq_len // page_size)
    example = most + 3  # pool pages while tracing (any count: dim 0 is dynamic)
    pool = model.new_pool(example, page_size, placeholder=True)
    leaves, spec, pool_devices = _flat_cache(pool)

    def paged_decode(module, tokens, positions, pages, *pool_leaves):
        return paged(module, tokens, positions, pages, None, pool_leaves)

    def paged_prefill(module, tokens, positions, pages, keep, *pool_leaves):
        return paged(module, tokens, positions, pages, keep, pool_leaves)

    def paged(module, tokens, positions, pages, keep, pool_leaves):
        entries = pytree.tree_unflatten(list(pool_leaves), spec)
        out, new = model.forward_path(tokens, positions, entries[0], 0, module.stages(), window=pages.shape[1] * page_size, pages=pages, keep=keep)
        return (logits_out(out), *pytree.tree_leaves([new]))

    pool_dim = torch.export.Dim("pool_pages", min=2)
    pool_args = [dict(a, shape=["P", *a["shape"][1:]]) for a in cache_arg_specs(leaves, pool_devices)]
    specs = {}
    calls = [("prefill_paged", 1, 8, 2)] + [("decode_paged", b, 1, most) for b in batch_sizes]
    for kind, rows_in, seq, table in calls:
        name = f"{kind}_bs{rows_in}"
        tokens = torch.zeros(rows_in, seq, dtype=torch.int64)
        positions = torch.arange(seq)[None, :].expand(rows_in, seq).clone()
        pages = torch.zeros(rows_in, table, dtype=torch.int64)
        named = [("tokens", [rows_in, 1]), ("positions", [rows_in, 1]), ("pages", [rows_in, most])]
        if kind == "prefill_paged":
            s = torch.export.Dim("seq_len", min=2, max=max_seq_len)
            wp = torch.export.Dim("window_pages", min=2, max=most)
            k = torch.export.Dim("kept", min=1, max=max_seq_len)
            named = [("tokens", [1, "S"]), ("positions", [1, "S"]), ("pages", [1, "Wp"]), keep_arg(1)]
            indices = (tokens, positions, pages, _example(keep_arg(1)[1], seq))
            dynamic = ({1: s}, {1: s}, {1: wp}, {1: k}, tuple({0: pool_dim} for _ in leaves))
            fn = paged_prefill
        else:
            indices = (tokens, positions, pages)
            dynamic = (None, None, None, tuple({0: pool_dim} for _ in leaves))
            fn = paged_decode
        devices = [first_device] * len(indices) + pool_devices
        arg_device = {i: DeviceAffinity(d) for i, d in enumerate(devices)}
        trace_program(fxb, fn, (*indices, *leaves), name=name, arg_device=arg_device, dynamic=dynamic, **trace)
        length = 1 if kind == "decode_paged" else "K"
        specs[name] = {
            "batch_size": rows_in,
            "args": [{"name": n, "shape": shape, "dtype": "int64", "device": first_device} for n, shape in named] + pool_args,
            "results": [{"name": "logits", "shape": [rows_in, length, model.config.vocab_size], "dtype": logits_dtype(model)}]
            + [{"name": f"cache.{i}", "same_as_arg": len(named) + i} for i in range(len(leaves))],
            "cache": {"paths": [0], "rows": [[0, rows_in]], "max_seq_len": max_seq_len, "page_size": page_size, "max_pages": most},
        }
    return specs
