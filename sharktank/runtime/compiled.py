"""Running an export artifact with the IREE runtime: prefill, decode, greedy generation.

:class:`CompiledModel` reads ``manifest.json``, checks it (paths stay inside the artifact,
archives and module match their sha256, compiler and runtime versions agree, the CPU is
the one a ``host`` module was built for, enough devices exist), creates the devices,
loads every parameter archive into one index for scope ``model`` and places each input on
the device its argument was exported for. The KV cache stays on the devices between calls.

A file is hashed once: one unchanged since its sha256 matched is known from a record of
what was verified (:mod:`sharktank.runtime.verified`). Loading ends with one call that
waits for the module's initialisation, while the archive pages it has read are released
(:meth:`Session.settle`), so a loaded model holds about one copy of its weights.
"""

from __future__ import annotations

import time
from importlib import metadata
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from ..export.compile import TARGETS
from ..export.manifest import ArgSpec, ArtifactError, FunctionSpec, Manifest, find_function, path_inside
from .inputs import InputError, check_chunk, check_keep, kept_logits, last_positions
from .paged import PagedCalls
from .session import WORKER_SPIN_US, Session
from .verified import VerifiedFiles

__all__ = ["ArtifactError", "InputError", "ModelLost", "read_manifest", "PrefillDecode", "CompiledModel", "generate_greedy"]


class ModelLost(RuntimeError):
    """The model can take no more calls (a host of a multi-host artifact failed or left):
    whoever drives it should stop rather than retry."""


def read_manifest(directory: str | Path) -> Manifest:
    """``directory``'s one-program manifest, checked (:meth:`Manifest.read`)."""
    return Manifest.read(directory)


def _check_file(directory: Path, name: str, sha: str | None, manifest: Path, verified: VerifiedFiles) -> Path:
    path = path_inside(directory, name, manifest)
    if not path.is_file():
        raise ArtifactError(f"{path}: missing (named by {manifest})")
    if sha is not None and not verified.matches(path, sha):
        raise ArtifactError(f"{path}: sha256 does not match {manifest}; the file changed or is corrupt")
    return path


# Prompt tokens a batch-1 prefill computes per call, as llama.cpp's 512-token ubatches: a longer
# prompt is prefilled in chunks of this many through prefill_chunk_bs1 (where exported), each
# chunk's scores over the entries before it only instead of the whole prompt's S x S (at 2048
# tokens: 40 % of a whole prefill's work is attention, half of it masked away).
PREFILL_CHUNK = 512


class PrefillDecode:
    """``prefill``, ``prefill_row``, ``prefill_rows``, ``decode`` and ``generate``: what ``run``
    and the serving engine call, written once on a subclass's ``forward(kind, tokens,
    positions, cache, *, batch, row, lengths)``, ``new_cache(batch)`` and
    ``_cache_batch(cache)``. :class:`CompiledModel` runs them on its devices,
    ``distributed.DistributedModel`` down a pipeline of hosts.

    ``functions``: the exported functions' specs by name (:class:`FunctionSpec`: kind, batch
    size, arguments, cache length); ``find(kind, batch)`` looks one up. ``idle()``: called by a driver with nothing to run, often (every few tens of ms):
    a model that must keep a connection alive does it there; it raises :class:`ModelLost`
    when the model is gone."""

    manifest: Manifest

    @property
    def functions(self) -> Mapping[str, FunctionSpec]:
        return self.manifest.functions

    def find(self, kind: str, batch: int) -> FunctionSpec | None:
        """``kind``'s exported function for batch size ``batch``, or None."""
        return find_function(self.functions, kind, batch)

    def idle(self) -> None:
        pass

    def prefill(self, tokens: torch.Tensor, cache: list | None = None, *, logits: str = "all") -> tuple[torch.Tensor, list]:
        """``(logits [B, S, vocab], cache)`` for a prompt from position 0. ``logits="last"``:
        only each row's last position's, ``[B, 1, vocab]``: what generation needs, and the
        final norm and LM head then run for that position only (every prefill method takes
        it; an artifact exported before it existed computes all and returns the same)."""
        _check_tokens(tokens)
        cache = cache if cache is not None else self.new_cache(tokens.shape[0])
        b, s = tokens.shape
        keep = last_positions(logits, [s - 1] * b)
        if b == 1 and s > self.prefill_chunk_tokens and self._cache_batch(cache) == 1 and self.find("prefill_chunk", 1) is not None:
            return self._prefill_in_chunks(tokens[0].tolist(), cache, logits)
        positions = torch.arange(s)[None, :].expand(b, -1).contiguous()
        return self.forward("prefill", tokens, positions, cache, keep=keep)

    prefill_chunk_tokens: int = PREFILL_CHUNK
    """A batch-1 :meth:`prefill` of a longer prompt runs as chunks of this many tokens through
    ``prefill_chunk_bs1`` where the artifact has it (:data:`PREFILL_CHUNK`; set it on an
    instance to change it): each chunk attends over the entries before it only. The logits
    equal the whole prompt's up to rounding (the last logits were bit-identical for a Q8_0
    SmolLM2 at 2048 tokens), and that prompt took 4.52 s in chunks of 512 against 6.04 s whole
    (``tools/bench_long_prefill.py``, 2 cores)."""

    def _prefill_in_chunks(self, prompt: list[int], cache: list, logits: str) -> tuple[torch.Tensor, list]:
        n, outs = self.prefill_chunk_tokens, []
        for start in range(0, len(prompt), n):
            end = min(start + n, len(prompt))
            out, cache = self.prefill_chunk(prompt, start, end, 0, cache, logits="last" if logits == "last" else "all")
            outs.append(out)
        return (outs[-1] if logits == "last" else torch.cat(outs))[None], cache

    def prefill_row(self, tokens: torch.Tensor, row: int, cache: list, *, logits: str = "all") -> tuple[torch.Tensor, list]:
        """``(logits [1, S, vocab], cache)`` for one prompt ``[1, S]`` prefilled from position 0
        into batch row ``row`` of ``cache`` (a cache of any exported batch size, from
        :meth:`new_cache` or a previous call); past the prompt the row keeps what it held (a
        program of several microbatches writes zeros there), never read (the causal mask:
        the row's next writes come first), and the other rows are left as they were.
        ``logits="last"``: ``[1, 1, vocab]`` (:meth:`prefill`)."""
        _check_tokens(tokens)
        if tokens.shape[0] != 1:
            raise InputError(f"prefill_row takes one prompt (tokens [1, S]), found tokens {list(tokens.shape)}")
        batch = self._cache_batch(cache)
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < batch:
            raise InputError(f"row must be an integer in [0, {batch}) for a batch-{batch} cache, found {row!r}")
        positions = torch.arange(tokens.shape[1])[None, :]
        keep = last_positions(logits, [tokens.shape[1] - 1])
        if batch == 1:  # prefill_row_bs1 would be prefill_bs1 (not exported)
            return self.forward("prefill", tokens, positions, cache, keep=keep)
        return self.forward("prefill_row", tokens, positions, cache, batch=batch, row=row, keep=keep)

    def prefill_rows(
        self, prompts: Sequence[Sequence[int]], rows: Sequence[int], cache: list, *, logits: str = "all"
    ) -> tuple[list[torch.Tensor], list]:
        """``(logits, cache)``: each prompt ``prompts[i]`` (token ids) prefilled from position 0
        into batch row ``rows[i]`` of ``cache`` in one ``prefill_rows_bs{B}`` call; ``logits[i]``
        is prompt ``i``'s ``[len(prompts[i]), vocab]``. Every prompt is right-padded to the
        longest and rows not named run padding of length 0, whose cache writes are dropped: the
        call costs a batch-``B`` prefill of that length, and rows not named keep their caches
        bit for bit. What a named row holds past its own prompt is never attended to (causal
        mask). Whether a few prompts are better prefilled one :meth:`prefill_row` each (which
        computes one row only: cheaper where prefill is compute-bound) is the caller's choice;
        the serving scheduler makes it (``serving.scheduler.prefill_calls``). ``logits="last"``:
        each ``logits[i]`` is its prompt's last position's, ``[1, vocab]`` (:meth:`prefill`)."""
        batch = self._cache_batch(cache)
        if not isinstance(prompts, (list, tuple)) or not isinstance(rows, (list, tuple)) or len(prompts) != len(rows) or not prompts:
            raise InputError(f"prefill_rows takes as many rows as prompts (at least one), found {_count(prompts)} prompts and {_count(rows)} rows")
        if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < batch for r in rows) or len(set(rows)) != len(rows):
            raise InputError(f"rows must be distinct integers in [0, {batch}) for a batch-{batch} cache, found {list(rows)!r}")
        if any(not isinstance(p, (list, tuple)) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts):
            raise InputError("each prompt must be a non-empty list of integer token ids")
        if self.find("prefill_rows", batch) is None:
            raise InputError(f"no prefill_rows function for batch size {batch} (export it with --functions, or prefill each prompt with prefill_row)")
        s = max(2, *(len(p) for p in prompts))  # the exported length is at least 2; padding is dropped
        tokens = torch.zeros(batch, s, dtype=torch.int64)
        lengths = [0] * batch
        for prompt, row in zip(prompts, rows):
            tokens[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.int64)
            lengths[row] = len(prompt)
        positions = torch.arange(s)[None, :].expand(batch, -1).contiguous()
        keep = last_positions(logits, [max(n - 1, 0) for n in lengths])
        out, cache = self.forward("prefill_rows", tokens, positions, cache, lengths=lengths, keep=keep)
        return [out[row, : 1 if keep else len(prompt)] for prompt, row in zip(prompts, rows)], cache

    def prefill_chunk(self, prompt: Sequence[int], start: int, end: int, row: int, cache: list, *, logits: str = "all") -> tuple[torch.Tensor, list]:
        """``(logits [end - start, vocab], cache)``: ``prompt[start:end]`` (token ids) written into
        batch row ``row`` at positions ``start .. end - 1``, attending over the row's entries
        ``0 .. end - 1``; entries before ``start`` must hold ``prompt[:start]`` (an earlier chunk,
        or a prefix the row already holds). Chunked prefill calls it once per chunk; the other
        rows, and the row's entries from ``end`` on, are left as they were.

        The exported chunk is at least 2 tokens: a one-token chunk is run as the two tokens
        ending at it (the earlier token's entries are rewritten with what they hold, up to
        rounding), and a one-token prompt as itself plus a dummy token at position 1, which the
        sequence's next write (its first decode step) replaces before anything reads it.
        ``logits="last"``: the chunk's last position's, ``[1, vocab]`` (:meth:`prefill`)."""
        batch = self._cache_batch(cache)
        spec = self.find("prefill_chunk", batch)
        if spec is None:
            raise InputError(f"no prefill_chunk function for batch size {batch} (artifacts of several microbatches, or exported before it existed, have none)")
        check_chunk(prompt, start, end)
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < batch:
            raise InputError(f"row must be an integer in [0, {batch}) for a batch-{batch} cache, found {row!r}")
        if max(end, 2) > spec.max_seq_len:
            raise InputError(f"a chunk ending at position {end - 1} is past the exported cache length {spec.max_seq_len}")
        ids, first = list(prompt[start:end]), start
        if len(ids) == 1 and start > 0:
            ids, first = [prompt[start - 1], *ids], start - 1
        elif len(ids) == 1:
            ids = [*ids, 0]
        tokens = torch.tensor([ids], dtype=torch.int64)
        positions = torch.arange(first, first + len(ids))[None, :]
        keep = last_positions(logits, [end - 1 - first])
        out, cache = self.forward("prefill_chunk", tokens, positions, cache, batch=batch, row=row, span=first + len(ids), keep=keep)
        return (out[0] if keep else out[0, start - first : start - first + end - start]), cache

    def decode(self, tokens: torch.Tensor, cache: list, positions: torch.Tensor) -> tuple[torch.Tensor, list]:
        """``(logits [B, 1, vocab], cache)`` for one token per sequence at ``positions`` ``[B]``."""
        if not (isinstance(tokens, torch.Tensor) and isinstance(positions, torch.Tensor)) or tokens.numel() != positions.numel():
            raise InputError("decode takes one token and one position per sequence (tokens [B], positions [B])")
        return self.forward("decode", tokens.reshape(-1, 1), positions.reshape(-1, 1).to(torch.int64).contiguous(), cache)

    def generate(self, tokens: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy ids ``[B, max_new_tokens]`` and the logits of every step ``[B, steps, vocab]``."""
        return generate_greedy(self, tokens, max_new_tokens)


class CompiledModel(PagedCalls, PrefillDecode):
    """A compiled artifact on its devices. ``prefill``/``decode`` take and return torch tensors.

    ``driver``: the IREE runtime driver; by default the one the artifact was compiled for.
    A CPU module runs on ``local-task`` (a pool of worker threads: faster on larger work) or
    ``local-sync`` (inline on the calling thread, no hand-offs: faster for small models and
    many small dispatches: toy-llama-3l decode ~0.35 against ~0.6 ms on 2 cores).
    ``worker_spin_us``: how long local-task's workers spin for the next dispatch before they
    sleep (:data:`~sharktank.runtime.session.WORKER_SPIN_US`; 0: they sleep at once)."""

    _host_program = False  # True in the runtime of one host of a multi-host artifact

    def __init__(self, directory: str | Path, *, verify: bool = True, driver: str | None = None, worker_spin_us: int = WORKER_SPIN_US):
        from ..export.artifact import host_cpu

        self.directory = Path(directory)
        m = self.manifest = read_manifest(self.directory)
        mpath = m.path
        if (m.host is not None) != self._host_program:
            raise ArtifactError(
                f"{self.directory}: host {m.host.get('host')}'s program of a {m.host.get('hosts')}-host artifact; "
                f"run the artifact's top directory with torchrun or `sharktank run DIR --distributed`"
                if m.host is not None else f"{self.directory}: not one host's program of a multi-host artifact"
            )
        if not m.module.get("vmfb") or not m.compile:
            raise ArtifactError(f"{self.directory}: not compiled yet; run `sharktank compile {self.directory}`")
        built = m.versions.get("iree-base-compiler")
        here = metadata.version("iree-base-runtime")
        if built != here:
            raise ArtifactError(
                f"{self.directory}: module built by iree-base-compiler {built}, but this runtime is "
                f"iree-base-runtime {here}; they must match (recompile with `sharktank compile`)"
            )
        info = m.compile
        if info.get("host_cpu") and info["host_cpu"] != host_cpu():
            raise ArtifactError(
                f"{self.directory}: compiled for host CPU {info['host_cpu']}, but this CPU is {host_cpu()}; "
                f"recompile here with `sharktank compile {self.directory}` or export with --target-arch generic"
            )
        # Files verified before and unchanged since are not hashed again (see runtime.verified).
        self.verified = VerifiedFiles(self.directory)
        vmfb = _check_file(self.directory, m.module["vmfb"], m.module.get("vmfb_sha256") if verify else None, mpath, self.verified)
        files = [
            _check_file(self.directory, name, f["sha256"] if verify else None, mpath, self.verified)
            for name, f in m.parameters["files"].items()
        ]
        self.verified.save()
        self.device_count = m.device_count
        self.driver = driver or info["driver"]
        target = TARGETS.get(info.get("target"))
        allowed = target.drivers if target else (info["driver"],)
        if self.driver not in allowed:
            raise ArtifactError(f"{self.directory}: compiled for {info.get('target')}, which runs on driver {' or '.join(allowed)}, not {self.driver!r}")
        self._check_devices(self.driver)
        try:
            self.session = Session(str(vmfb), self.device_count, self.driver, {m.parameters["scope"]: [str(f) for f in files]}, worker_spin_us)
            self.session.settle(self._first_call)
        except (RuntimeError, ValueError) as e:  # the runtime's own words, first line only
            raise ArtifactError(f"{self.directory}: the module does not load with its parameters: {str(e).splitlines()[0]}") from None
        self.vocab_size = m.vocab_size
        self.timings: dict[str, list[float]] = {"prefill": [], "decode": []}

    def _first_call(self) -> None:
        """One decode on a scratch cache: it waits for the module's initialisation (weights
        loaded and packed), so that loading ends with the model ready and its memory settled."""
        spec = self.manifest.smallest("decode")
        tokens, positions = spec.args[:2]
        zeros = np.zeros((spec.batch_size, 1), np.int64)
        self.session.invoke(spec.name, [self.session.place(zeros, tokens.device), self.session.place(zeros, positions.device), *self.new_cache(spec.batch_size)])

    def _check_devices(self, driver: str) -> None:
        if driver in TARGETS["cpu"].drivers:
            return  # any number of logical CPU devices can be created
        import iree.runtime as rt

        try:
            found = len(rt.get_driver(driver).query_available_devices())
        except Exception as e:  # the driver itself is missing (no GPU runtime here)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__  # the HIP error runs to many lines
            raise ArtifactError(f"{self.directory}: needs {self.device_count} {driver} devices; the {driver} driver is unavailable ({why})") from None
        if found < self.device_count:
            raise ArtifactError(f"{self.directory}: needs {self.device_count} {driver} devices, found {found}")

    # --- calls -----------------------------------------------------------------------------
    def function(self, kind: str, batch: int) -> FunctionSpec:
        """``kind``'s exported function for batch size ``batch`` (InputError when there is none)."""
        spec = self.find(kind, batch)
        if spec is None:
            raise InputError(f"no {kind} function for batch size {batch}; exported batch sizes: {list(self.manifest.batch_sizes)}")
        return spec

    def new_cache(self, batch: int) -> list:
        spec = self.function("prefill", batch)
        return [self.zeros(a.shape, a) for a in spec.cache_args]

    def zeros(self, shape: Sequence[int], arg: ArgSpec):
        """A zeroed device array of ``shape`` in ``arg``'s dtype on ``arg``'s device."""
        if arg.dtype == "bfloat16":  # numpy has no bfloat16: zeros as uint16 bits
            import iree.runtime as rt

            return self.session.place(np.zeros(shape, np.uint16), arg.device, rt.HalElementType.BFLOAT_16)
        return self.session.place(np.zeros(shape, np.dtype(arg.dtype)), arg.device)

    def check_inputs(self, spec: FunctionSpec, tokens: torch.Tensor, positions: torch.Tensor, cache: list) -> None:
        """Refuse what ``spec``'s function cannot take (positions, ids, cache arrays)."""
        # The module does not bound-check ids or positions: an id past the vocabulary or a
        # negative position indexes outside its buffers (garbage, or a segfault).
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != tokens.shape:
            found = f"{positions.dtype} {list(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise InputError(f"positions must be int64 of the tokens' shape {list(tokens.shape)}, found {found}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise InputError(f"token ids must be in [0, {self.vocab_size}), found {int(tokens.min())}..{int(tokens.max())}")
        limit = spec.max_seq_len
        if int(positions.min()) < 0:
            raise InputError(f"positions must be >= 0, found {int(positions.min())}")
        if int(positions.max()) >= limit:
            raise InputError(f"position {int(positions.max())} is past the exported cache length {limit}")
        if spec.kind not in ("decode", "prefill_chunk") and int(positions.max()) >= tokens.shape[1]:
            # A prefill attends over its own S cache entries (a prompt from position 0).
            raise InputError(f"{spec.name} prefills a prompt from position 0: positions must be below its length {tokens.shape[1]}, found {int(positions.max())}")
        count = len(spec.cache_args)
        if not isinstance(cache, (list, tuple)) or len(cache) != count:
            found = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
            raise InputError(f"{spec.name} takes a cache of {count} arrays (from new_cache or the previous call), found {found}")

    def forward(
        self,
        kind: str,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: list,
        *,
        batch: int | None = None,
        row: int | None = None,
        lengths: list[int] | None = None,
        span: int | None = None,
        keep: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, list]:
        """One call of ``{kind}_bs{batch}`` (``batch``: by default the tokens' rows; ``row``:
        the batch row a ``prefill_row`` function writes; ``lengths``: each row's real tokens,
        for ``prefill_rows``; ``keep``: per row, the positions whose logits a prefill
        returns, ``[B, K, vocab]``; None: all of them)."""
        _check_tokens(tokens)
        spec = self.function(kind, tokens.shape[0] if batch is None else batch)
        self.check_inputs(spec, tokens, positions, cache)
        check_keep(keep, tokens.shape)
        devices = [a.device for a in spec.args]
        t0 = time.perf_counter()
        inputs = [self.session.place(tokens.numpy(), devices[0]), self.session.place(positions.numpy(), devices[1])]
        everything = [list(range(tokens.shape[1]))] * tokens.shape[0]
        for extra in ([row] if row is not None else None, lengths, list(range(span)) if span is not None else None, (keep or everything) if spec.takes_keep else None):
            if extra is not None:
                inputs.append(self.session.place(np.array(extra, np.int64), devices[len(inputs)]))
        out = self.session.invoke(spec.name, [*inputs, *cache])
        logits = self._to_torch(out[0])
        if keep is not None and not spec.takes_keep:  # exported before `keep` existed: every position came back
            logits = kept_logits(logits, keep)
        self.timings.setdefault(kind, []).append(time.perf_counter() - t0)
        return logits, list(out[1:])

    def _to_torch(self, array) -> torch.Tensor:
        host = torch.from_numpy(np.array(array.to_host()))
        # bfloat16 logits come back as their int16 bits (numpy has no bfloat16; see export).
        return host.view(torch.bfloat16) if self.manifest.dtype == "bfloat16" else host

    def _cache_batch(self, cache: list) -> int:
        """The batch size whose cache arrays have the shapes of ``cache``'s."""
        shapes = [tuple(a.shape) for a in cache] if isinstance(cache, (list, tuple)) and all(hasattr(a, "shape") for a in cache) else None
        for spec in self.functions.values():
            if shapes == [a.shape for a in spec.cache_args]:
                return spec.batch_size
        found = [list(s) for s in shapes] if shapes is not None else type(cache).__name__
        raise InputError(f"the cache matches no exported batch size {list(self.manifest.batch_sizes)} (from new_cache(batch)); found arrays of shapes {found}")


def generate_greedy(model, tokens: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ids ``[B, max_new_tokens]`` and the logits of every step ``[B, steps, vocab]``
    from any model with :class:`CompiledModel`'s ``prefill`` and ``decode``."""
    _check_tokens(tokens)
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, found {max_new_tokens}")
    b, s = tokens.shape
    logits, cache = model.prefill(tokens, logits="last")
    steps = [logits[:, -1]]
    ids = []
    pos = torch.full((b,), s, dtype=torch.int64)
    for i in range(max_new_tokens):
        nxt = steps[-1].argmax(-1)
        ids.append(nxt)
        if i + 1 < max_new_tokens:
            logits, cache = model.decode(nxt, cache, pos)
            steps.append(logits[:, -1])
            pos = pos + 1
    if not ids:
        return torch.empty(b, 0, dtype=torch.int64), logits[:, :0]
    return torch.stack(ids, 1), torch.stack(steps, 1)


def _count(x) -> str:
    return str(len(x)) if isinstance(x, (list, tuple)) else type(x).__name__


def _check_tokens(tokens: torch.Tensor) -> None:
    """Tokens must be a non-empty int64 ``[B, S]`` tensor (checked before any size is read)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.ndim != 2 or tokens.numel() == 0:
        found = f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise InputError(f"tokens must be int64 [B, S] with B, S >= 1, found {found}")
