"""Running a multi-host artifact: one process per host, boundary tensors over torch.distributed.

Rank ``r`` runs host ``r``'s program (``DIR/host_{r}``, loaded and checked as
:class:`CompiledModel` loads an artifact) and opens no other host's files: only
``DIR/manifest.json`` and ``DIR/host_{r}/``. Rank 0 owns the prompt, the greedy loop and the
output. Each step goes down the pipeline and the logits come back to rank 0:

- rank ``r`` sends rank ``r + 1`` a header (``int64 [op, batch, seq]``: the function, its
  batch size and the sequence length), for ``prefill_row`` the row (``int64 [1]``), the
  hidden state ``[rows, S, D]`` and the positions ``[rows, S]``; each rank calls that same
  function of its own program on its own cache of that batch size (a prefill starts a new
  one);
- the last rank sends the logits ``[rows, S, vocab]`` to rank 0;
- a ping header goes round the ring (the last rank returns it to rank 0): a rank-0 driver
  with nothing to run pings every :data:`HEARTBEAT_S` (:meth:`DistributedModel.idle`), so
  an idle server notices a lost rank within about that, and the other ranks, whose every
  wait is bounded, keep hearing from rank 0;
- a stop header ends the ranks' loops; each rank then leaves its counters of bytes sent in
  the rendezvous store, where rank 0 reads them (:attr:`DistributedModel.traffic`).

So the other ranks run exactly the calls rank 0 makes, in its order: what rank 0's
:class:`DistributedModel` is given (``prefill``, ``prefill_row``, ``decode``: the interface
of :class:`CompiledModel`) travels down the pipeline with the boundary tensors.

Failure: every wait is bounded by ``timeout_s`` (rendezvous, joining, each send and
receive). A rank that exits or crashes closes its connections, which its peers see at once;
the rank that sees it raises :class:`DistributedError` naming the rank it lost, leaves that
message in the store and exits, so the failure travels along the pipeline in well under the
bound. A rank that hangs, or never joins, is reported when the bound runs out. On rank 0 a
failure is final: every later call raises the same error (a :class:`ModelLost`).

The rendezvous store (rank 0, or torchrun's agent under torchrun) and every gloo connection
carry unencrypted traffic: run this on a private network only.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ..export.manifest import FunctionSpec, HostsManifest, path_inside
from .compiled import ArtifactError, CompiledModel, InputError, ModelLost, PrefillDecode
from .inputs import check_keep, kept_logits

__all__ = ["DistributedError", "DistributedEnv", "DistributedModel", "HostProgram", "read_hosts_manifest", "DEFAULT_TIMEOUT_S", "HEARTBEAT_S"]

DEFAULT_TIMEOUT_S = 60.0
REPORT_TIMEOUT_S = 2.0  # a failing rank's reads and writes of the others' failure reports
HEARTBEAT_S = 1.0  # an idle rank-0 driver pings the other ranks this often (at most)
STOP, PREFILL, DECODE, PREFILL_ROW, PING = 0, 1, 2, 3, 4
_OPS = {"prefill": PREFILL, "decode": DECODE, "prefill_row": PREFILL_ROW}
_KINDS = {op: kind for kind, op in _OPS.items()}


class DistributedError(ModelLost):
    """A rank failed, hung or never joined; the message names it."""


def _wire_dtype(name: str) -> np.dtype:
    return np.dtype(np.int16) if name.startswith("int16") else np.dtype(name)


def read_hosts_manifest(directory: str | Path) -> HostsManifest:
    """The top-level manifest of a multi-host artifact, checked (:meth:`HostsManifest.read`)."""
    return HostsManifest.read(directory)


class HostProgram(CompiledModel):
    """One host's program of a multi-host artifact: its functions take tokens or the hidden
    state and return the hidden state or logits (see :mod:`sharktank.export.hosts`)."""

    _host_program = True

    def _first_call(self) -> None:
        spec = self.manifest.smallest("decode")
        a, p = spec.args[:2]
        inputs = [self.session.place(np.zeros(a.shape, _wire_dtype(a.dtype)), a.device), self.session.place(np.zeros(p.shape, np.int64), p.device)]
        self.session.invoke(spec.name, [*inputs, *self.new_cache(spec.batch_size)])

    def call(self, kind: str, x: np.ndarray, positions: np.ndarray, cache: list, *, batch: int | None = None, row: int | None = None) -> tuple[np.ndarray, list]:
        """``(hidden or logits, cache)`` of ``{kind}_bs{batch}`` (prefill, decode or prefill_row
        into ``row``; ``batch``: by default ``x``'s rows) on ``x`` (tokens or hidden)."""
        spec = self.function(kind, x.shape[0] if batch is None else batch)
        a, p = spec.args[:2]
        t0 = time.perf_counter()
        inputs = [self.session.place(x, a.device), self.session.place(positions, p.device)]
        if row is not None:
            inputs.append(self.session.place(np.array([row], np.int64), spec.args[2].device))
        out = self.session.invoke(spec.name, [*inputs, *cache])
        result = np.array(out[0].to_host())
        self.timings.setdefault(kind, []).append(time.perf_counter() - t0)
        return result, list(out[1:])


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits: the variables torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); ``agent_store``: torchrun's agent already runs the
    rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool = False

    @classmethod
    def from_environ(cls, environ=os.environ) -> "DistributedEnv":
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
        if missing:
            raise ArtifactError(f"distributed run needs {', '.join(missing)} in the environment (torchrun sets them)")
        try:
            rank, world, port = int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["MASTER_PORT"])
        except ValueError:
            raise ArtifactError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers, found {environ['RANK']!r}, {environ['WORLD_SIZE']!r}, {environ['MASTER_PORT']!r}") from None
        if not 0 <= rank < world:
            raise ArtifactError(f"RANK must be in [0, WORLD_SIZE={world}), found {rank}")
        return cls(rank, world, environ["MASTER_ADDR"], port, environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


class DistributedModel(PrefillDecode):
    """This host's share of a multi-host artifact, connected to the other hosts.

    On rank 0: ``prefill``, ``prefill_row``, ``decode``, ``new_cache``, ``generate`` and
    ``idle`` as :class:`CompiledModel` has them (the cache is rank 0's; every other rank keeps
    its own share, one per batch size), then :meth:`close` (which stops the other ranks).
    Calls may come from any thread, one at a time. On any other rank: :meth:`serve`, which
    runs its stages for every call rank 0 sends until rank 0 stops it.

    ``timeout_s`` bounds every wait (rendezvous, joining, each message). ``bind``: the
    address this rank's gloo connections listen on (default: ``MASTER_ADDR`` on rank 0 or
    when it is a loopback address; otherwise the address this host's name resolves to)."""

    def __init__(self, directory: str | Path, env: DistributedEnv, *, timeout_s: float = DEFAULT_TIMEOUT_S, driver: str | None = None, bind: str | None = None):
        self.directory = Path(directory)
        self.env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.timeout_s = timeout_s
        m = self.manifest = read_hosts_manifest(self.directory)
        hosts = m.hosts
        if env.world_size != len(hosts):
            raise ArtifactError(f"{self.directory}: the artifact runs on {len(hosts)} hosts, but WORLD_SIZE is {env.world_size}; start one rank per host ({len(hosts)})")
        self.host = hosts[self.rank]
        sub = path_inside(self.directory, self.host.dir, self.directory / "manifest.json")
        if not (sub / "manifest.json").is_file():
            raise ArtifactError(f"{sub}: missing; host {self.rank} needs its directory {self.host.dir} (copied from the export)")
        digest = hashlib.sha256((sub / "manifest.json").read_bytes()).hexdigest()
        if digest != self.host.manifest_sha256:
            raise ArtifactError(f"{sub / 'manifest.json'}: sha256 does not match {self.directory / 'manifest.json'}; the host's program changed")
        self.program = HostProgram(sub, driver=driver)
        self.driver = self.program.driver
        self.device_count = self.program.device_count
        self.vocab_size = m.vocab_size
        # Hidden states and logits cross in the model's dtype, bfloat16 as its int16 bits.
        self.wire_dtype = torch.int16 if m.dtype == "bfloat16" else getattr(torch, m.dtype)
        self.timings: dict[str, list[float]] = {"prefill": [], "decode": []}
        self.sent = {"prefill": 0, "decode": 0, "prefill_row": 0, "steps": {"prefill": 0, "decode": 0, "prefill_row": 0}}
        self.traffic: dict[int, dict] = {}
        self._lock = threading.Lock()  # one exchange with the other ranks at a time
        self._lost: DistributedError | None = None  # rank 0: the failure that ended the pipeline
        self._last_heard = time.monotonic()
        self._artifact = hashlib.sha256((self.directory / "manifest.json").read_bytes()).hexdigest()
        self._connect(bind)

    # --- rendezvous ------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"sharktank/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"

    def _connect(self, bind: str | None) -> None:
        from torch.distributed import ProcessGroupGloo, TCPStore

        env, timeout = self.env, datetime.timedelta(seconds=self.timeout_s)
        where = f"{env.master_addr}:{env.master_port}"
        try:
            if env.rank == 0 and not env.agent_store:
                # The store listens on the address it was given only (TCPStore alone would
                # listen on every interface): a socket bound here is handed to it.
                family = socket.AF_INET6 if ":" in env.master_addr else socket.AF_INET
                listener = socket.socket(family, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((env.master_addr, env.master_port))
                listener.listen(64)
                self.store = TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout=timeout,
                                      wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=False)
            else:
                self.store = TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout=timeout)
        except (RuntimeError, OSError) as e:
            raise DistributedError(f"rank {env.rank}: cannot reach the rendezvous at {where} within {self.timeout_s:g} s (is rank 0 running?): {str(e).splitlines()[0]}") from None
        self.store.set(self._key(f"joined/{env.rank}"), self._artifact)
        keys = [self._key(f"joined/{r}") for r in range(env.world_size)]
        try:
            self.store.wait(keys, timeout)
        except RuntimeError:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise DistributedError(f"rank {env.rank}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not join within {self.timeout_s:g} s") from None
        for r, k in enumerate(keys):
            if self.store.get(k).decode() != self._artifact:
                raise DistributedError(f"rank {env.rank}: rank {r} runs a different artifact (its {self.directory.name}/manifest.json differs from this rank's)")
        if bind is None and (env.rank == 0 or _is_loopback(env.master_addr)):
            bind = env.master_addr
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=bind) if bind else ProcessGroupGloo.create_default_device()]
        opts._timeout = timeout
        from torch.distributed import PrefixStore

        try:
            self.pg = ProcessGroupGloo(PrefixStore(self._key("gloo"), self.store), env.rank, env.world_size, opts)
        except RuntimeError as e:
            raise self._failed(None, "connecting to", e) from None

    # --- messages ----------------------------------------------------------------------------
    def _failed(self, peer: int | None, what: str, e: Exception) -> DistributedError:
        text = str(e)
        who = f"rank {peer}" if peer is not None else "the other ranks"
        if "Timed out" in text or "timed out" in text:
            why = f"{who} sent nothing for {self.timeout_s:g} s (hung or too slow; raise --timeout)"
        elif "closed" in text.lower() or "reset" in text.lower() or "Broken pipe" in text:
            why = f"{who} closed its connection (exited or crashed)"
        else:
            why = f"{who}: {text.splitlines()[0]}"
        msg = f"rank {self.rank}: {what} {why}"
        # The reports are best-effort and bounded: the store may live in the rank that hung
        # (rank 0 without torchrun), where a store call can block past any store timeout.
        reports: list[str] = []
        talk = threading.Thread(target=self._exchange_reports, args=(msg, reports), daemon=True)
        talk.start()
        talk.join(min(REPORT_TIMEOUT_S, self.timeout_s))
        if reports:
            msg += "; " + "; ".join(list(reports))
        return DistributedError(msg)

    def _exchange_reports(self, msg: str, reports: list[str]) -> None:
        """Read the other ranks' failure reports into ``reports``, then leave ``msg`` as this one's."""
        for r in range(self.world_size):
            key = self._key(f"failed/{r}")
            try:
                if r != self.rank and self.store.check([key]):
                    reports.append(self.store.get(key).decode())
            except RuntimeError:
                break  # the store went with rank 0
        try:
            self.store.set(self._key(f"failed/{self.rank}"), msg)
        except RuntimeError:
            pass

    def _send(self, t: torch.Tensor, peer: int, kind: str | None = None) -> None:
        try:
            self.pg.send([t.contiguous()], peer, 0).wait()
        except RuntimeError as e:
            self._lost = self._failed(peer, "sending to", e)
            raise self._lost from None
        if kind:
            self.sent[kind] += t.numel() * t.element_size()

    def _recv(self, shape, dtype, peer: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        try:
            self.pg.recv([t], peer, 0).wait()
        except RuntimeError as e:
            self._lost = self._failed(peer, "waiting for", e)
            raise self._lost from None
        return t

    def _header(self, op: int, batch: int = 0, seq: int = 0) -> torch.Tensor:
        return torch.tensor([op, batch, seq], dtype=torch.int64)

    def _forward(self, kind: str, x: np.ndarray, positions: np.ndarray, batch: int, row: int | None) -> None:
        """Send one call's header and boundary tensors to the next rank."""
        nxt = self.rank + 1
        self._send(self._header(_OPS[kind], batch, positions.shape[1]), nxt, kind)
        if row is not None:
            self._send(torch.tensor([row], dtype=torch.int64), nxt, kind)
        self._send(torch.from_numpy(x), nxt, kind)
        self._send(torch.from_numpy(positions), nxt, kind)

    # --- rank 0 --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _exchange(self):
        """Hold the pipeline for one exchange with the other ranks (raises the failure that ended them)."""
        if self.rank != 0:
            raise DistributedError(f"rank {self.rank}: only rank 0 takes prompts; the other ranks run serve()")
        with self._lock:
            if self._lost is not None:
                raise self._lost
            yield

    @property
    def functions(self) -> Mapping[str, FunctionSpec]:
        return self.program.functions  # every host exports the same names, batches, cache length

    def new_cache(self, batch: int) -> list:
        return self.program.new_cache(batch)

    def _cache_batch(self, cache: list) -> int:
        return self.program._cache_batch(cache)

    def forward(
        self, kind: str, tokens: torch.Tensor, positions: torch.Tensor, cache: list, *,
        batch: int | None = None, row: int | None = None, lengths: list[int] | None = None, keep: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, list]:
        """One call of ``{kind}_bs{batch}`` down the pipeline (as :meth:`CompiledModel.forward`;
        the last host computes every position's logits and ``keep`` selects them here).
        The pipeline's wire protocol carries prefill, decode and prefill_row: a ``lengths``
        call (``prefill_rows``) is refused. Host programs export no ``prefill_rows`` function,
        so :meth:`PrefillDecode.prefill_rows` refuses before it comes here and the serving
        scheduler prefills one row per call."""
        batch = tokens.shape[0] if batch is None else batch
        if kind not in _OPS or lengths is not None:
            raise InputError(f"a multi-host pipeline runs {', '.join(_OPS)} calls, not {kind}{' with lengths' if lengths is not None else ''}")
        spec = self.program.function(kind, batch)
        self.program.check_inputs(spec, tokens, positions, cache)
        check_keep(keep, tokens.shape)
        with self._exchange():
            t0 = time.perf_counter()
            hidden, cache = self.program.call(kind, tokens.numpy(), positions.numpy(), cache, batch=batch, row=row)
            self._forward(kind, hidden, positions.numpy(), batch, row)
            self.sent["steps"][kind] += 1
            logits = self._recv((*tokens.shape, self.vocab_size), self.wire_dtype, self.world_size - 1)
            self._last_heard = time.monotonic()
        if self.manifest.dtype == "bfloat16":
            logits = logits.view(torch.bfloat16)
        if keep is not None:
            logits = kept_logits(logits, keep)
        self.timings.setdefault(kind, []).append(time.perf_counter() - t0)
        return logits, cache

    def idle(self) -> None:
        """Nothing to run: ping the other ranks unless this rank heard from them within
        :data:`HEARTBEAT_S` (a quarter of the timeout if that is shorter); raises the
        :class:`DistributedError` of a lost rank."""
        with self._exchange():
            if time.monotonic() - self._last_heard < min(HEARTBEAT_S, self.timeout_s / 4):
                return
            self._send(self._header(PING), 1)
            self._recv((3,), torch.int64, self.world_size - 1)
            self._last_heard = time.monotonic()

    def close(self) -> None:
        """Rank 0: stop the other ranks and collect their byte counters into :attr:`traffic`
        (nothing to stop once a rank was lost: the others have gone or are going)."""
        if self.rank != 0 or self._lost is not None:
            return
        with self._lock:
            self._lost = DistributedError("rank 0: the model was closed")  # no call after this one
            self._send(self._header(STOP), 1)
        self.traffic = {0: self.sent}
        for r in range(1, self.world_size):
            key = self._key(f"done/{r}")
            try:
                self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise self._failed(r, "waiting for the end of", e) from None
            self.traffic[r] = json.loads(self.store.get(key))

    # --- ranks 1 .. N-1 ----------------------------------------------------------------------------
    def serve(self) -> None:
        """Run this rank's stages for every call rank 0 sends, until it sends stop."""
        if self.rank == 0:
            raise DistributedError("rank 0 drives the pipeline (generate); serve() runs on the other ranks")
        prev, last = self.rank - 1, self.rank == self.world_size - 1
        hidden_size = self.manifest.hidden_size
        caches: dict[int, list] = {}  # batch size -> this rank's share of rank 0's cache
        while True:
            op, b, s = self._recv((3,), torch.int64, prev).tolist()
            if op == PING:
                self._send(self._header(PING), 0 if last else self.rank + 1)
                continue
            if op == STOP:
                if not last:
                    self._send(self._header(STOP), self.rank + 1)
                self.store.set(self._key(f"done/{self.rank}"), json.dumps(self.sent))
                return
            kind = _KINDS[op]
            row = int(self._recv((1,), torch.int64, prev)) if op == PREFILL_ROW else None
            rows = 1 if op == PREFILL_ROW else b
            x = self._recv((rows, s, hidden_size), self.wire_dtype, prev).numpy()
            positions = self._recv((rows, s), torch.int64, prev).numpy()
            if op == PREFILL or b not in caches:
                caches[b] = self.program.new_cache(b)
            out, caches[b] = self.program.call(kind, x, positions, caches[b], batch=b, row=row)
            self.sent["steps"][kind] += 1
            if last:
                self._send(torch.from_numpy(out), 0, kind)
            else:
                self._forward(kind, out, positions, b, row)
