"""The artifact contract: ``manifest.json`` as ``sharktank export`` writes it, read and checked
once into typed values that every reader (run, compile, inspect, serve, perplexity, the
multi-host runtime) uses instead of raw dictionaries.

Two formats:

- ``sharktank.artifact`` (:class:`Manifest`): one compiled program over ``device_count``
  devices. Its ``functions`` are named ``{kind}_bs{B}`` (:func:`function_name`): ``prefill``,
  ``decode``, for ``B > 1`` ``prefill_row`` and ``prefill_rows``, and (single-microbatch
  programs exported since it existed) ``prefill_chunk``; each takes its arguments in the order
  of :attr:`FunctionSpec.args` (tokens or the hidden state, positions, then ``row``,
  ``lengths`` or ``row`` and ``span`` where the kind has them, then the ``cache.N`` arrays).
- ``sharktank.hosts`` (:class:`HostsManifest`): a multi-host artifact, one ``sharktank.artifact``
  program per host in ``host_N/``, each entry naming its directory and its manifest's sha256.

Every path a manifest names must stay inside its directory; the checks here say which field
is wrong and what was found. :attr:`Manifest.data` keeps the JSON as read, for the writer
(``compile`` updates it in place) and for ``inspect``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..weights._files import resolve_inside

__all__ = [
    "ArtifactError", "ArgSpec", "FunctionSpec", "Manifest", "HostsManifest", "HostEntry", "KINDS", "CONTIGUOUS_KINDS", "HOST_KINDS",
    "ARTIFACT_FORMAT", "HOSTS_FORMAT", "function_name", "parse_function_name", "find_function", "path_inside", "read_any",
    "parameter_bytes_per_device",
]

ARTIFACT_FORMAT = "sharktank.artifact"
HOSTS_FORMAT = "sharktank.hosts"
# The kinds of exported functions, in the order an artifact lists them.
KINDS = ("prefill", "decode", "prefill_row", "prefill_rows", "prefill_chunk", "prefill_paged", "decode_paged")
# The kinds over the contiguous cache (export's ``functions`` chooses among them; the paged
# ones come with a page size), and those a program per host has.
CONTIGUOUS_KINDS = KINDS[:5]
HOST_KINDS = ("prefill", "decode", "prefill_row")
_NAME = re.compile(r"(?P<kind>[a-z_]+)_bs(?P<batch>[1-9][0-9]*)")


class ArtifactError(ValueError):
    """An export artifact that cannot be run here; says what was expected and found."""


def function_name(kind: str, batch: int) -> str:
    """The exported name of ``kind``'s function for batch size ``batch``: ``decode_bs4``."""
    if kind not in KINDS:
        raise ValueError(f"function kind must be one of {KINDS}, found {kind!r}")
    return f"{kind}_bs{batch}"


def parse_function_name(name: str) -> tuple[str, int]:
    """``(kind, batch)`` of an exported name (the inverse of :func:`function_name`)."""
    m = _NAME.fullmatch(name)
    if not m or m["kind"] not in KINDS:
        raise ArtifactError(f"function name {name!r}: expected KIND_bsB with KIND in {KINDS}")
    return m["kind"], int(m["batch"])


@dataclass(frozen=True)
class ArgSpec:
    """One argument of an exported function: its name (``tokens``, ``positions``, ``row``,
    ``lengths``, ``span``, ``pages``, ``cache.N``...), shape (``"S"`` for the dynamic length,
    ``"W"`` for a chunk's attended window, ``"Wp"`` for a paged chunk's pages, ``"P"`` for a
    page pool's page count), dtype and device."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str
    device: int

    @property
    def is_cache(self) -> bool:
        return self.name.startswith("cache.")


@dataclass(frozen=True)
class FunctionSpec:
    """An exported function: ``name`` = ``function_name(kind, batch_size)``, its arguments in
    call order and the length of the KV cache it reads and writes."""

    name: str
    kind: str
    batch_size: int
    args: tuple[ArgSpec, ...]
    max_seq_len: int
    page_size: int | None = None  # the paged functions: positions per page of the pool
    max_pages: int | None = None  # and the pages of one sequence's table

    @property
    def cache_args(self) -> tuple[ArgSpec, ...]:
        return tuple(a for a in self.args if a.is_cache)

    @property
    def takes_keep(self) -> bool:
        """Whether the function takes ``keep``, the positions whose logits a prefill returns
        (artifacts exported before it compute every position's)."""
        return any(a.name == "keep" for a in self.args)

    @property
    def inputs(self) -> tuple[ArgSpec, ...]:
        """The arguments before the cache (tokens or hidden, positions, row or lengths)."""
        return tuple(a for a in self.args if not a.is_cache)


def _need(ok: bool, path: Path, what: str) -> None:
    if not ok:
        raise ArtifactError(f"{path}: {what}")


def _need_format(m: Any, fmt: str, path: Path, what: str, rest: str = ")") -> None:
    """Refuse JSON that is not an object of ``format`` ``fmt``: ``{path}: {what} (format F{rest}``."""
    if not isinstance(m, dict) or m.get("format") != fmt:
        found = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise ArtifactError(f"{path}: {what} (format {found!r}{rest}")


def find_function(functions: Mapping[str, FunctionSpec], kind: str, batch: int) -> FunctionSpec | None:
    """``kind``'s function for batch size ``batch`` among ``functions`` (by name), or None
    when it was not exported or ``kind`` is no function kind."""
    return functions.get(function_name(kind, batch)) if kind in KINDS else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _function(name: str, raw: Any, path: Path) -> FunctionSpec:
    kind, batch = parse_function_name(name)
    _need(isinstance(raw, dict) and isinstance(raw.get("args"), list), path, f"functions.{name} must be an object with an 'args' list")
    _need(raw.get("batch_size") == batch, path, f"functions.{name}.batch_size must be {batch}, found {raw.get('batch_size')!r}")
    length = (raw.get("cache") or {}).get("max_seq_len")
    _need(_is_int(length) and length > 0, path, f"functions.{name}.cache.max_seq_len must be a positive integer, found {length!r}")
    args = []
    for i, a in enumerate(raw["args"]):
        ok = isinstance(a, dict) and isinstance(a.get("name"), str) and isinstance(a.get("shape"), list) and isinstance(a.get("dtype"), str) and _is_int(a.get("device"))
        _need(ok, path, f"functions.{name}.args[{i}] must have name, shape, dtype and an integer device")
        args.append(ArgSpec(a["name"], tuple(a["shape"]), a["dtype"], a["device"]))
    _need(len(args) >= 2, path, f"functions.{name} takes at least tokens and positions, found {len(args)} arguments")
    paged = {k: (raw.get("cache") or {}).get(k) for k in ("page_size", "max_pages")}
    if kind.endswith("_paged"):
        ok = all(_is_int(v) and v > 0 for v in paged.values())
        _need(ok, path, f"functions.{name}.cache must give page_size and max_pages (positive integers), found {paged}")
    return FunctionSpec(name, kind, batch, tuple(args), length, paged["page_size"], paged["max_pages"])


def _load_json(directory: Path, made_by: str = "sharktank export") -> tuple[Path, Any]:
    """``(path, JSON)`` of ``directory/manifest.json``; ``made_by`` names the command whose
    output directory was expected, for the refusal when there is none."""
    path = directory / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{directory}: no manifest.json (is this a `{made_by}` output directory?)")
    try:
        return path, json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None


def path_inside(directory: Path, name: Any, manifest: Path) -> Path:
    """``directory / name``, refused (ArtifactError naming ``manifest``) when ``name`` is
    absolute, climbs out with ``..`` or is a symlink leading outside ``directory``."""
    try:
        return resolve_inside(directory, name, manifest=manifest)
    except ValueError as e:  # WeightsError: absolute, '..' or a symlink leading outside
        raise ArtifactError(str(e)) from None


# The fields every reader relies on, with their JSON types.
_FIELDS = {"model": dict, "parallel": dict, "device_count": int, "functions": dict, "parameters": dict, "module": dict, "versions": dict}


@dataclass(frozen=True)
class Manifest:
    """A ``sharktank.artifact`` manifest, checked (see the module docstring)."""

    directory: Path
    data: dict
    functions: Mapping[str, FunctionSpec]

    @classmethod
    def read(cls, directory: str | Path) -> "Manifest":
        """``directory/manifest.json``, checked. A multi-host artifact is refused with the
        command that runs it."""
        directory = Path(directory)
        path, m = _load_json(directory)
        if isinstance(m, dict) and m.get("format") == HOSTS_FORMAT:
            n = len(m.get("hosts") or ())
            raise ArtifactError(
                f"{directory}: a multi-host artifact ({n} hosts); run it on every host with `torchrun --nnodes {n} "
                f"--nproc-per-node 1 ... -m sharktank.cli run {directory} ...` or `sharktank run {directory} --distributed`"
            )
        return cls.from_dict(m, directory)

    @classmethod
    def from_dict(cls, m: Any, directory: str | Path) -> "Manifest":
        """The manifest ``m`` (as JSON decodes it) of the artifact in ``directory``, checked."""
        directory = Path(directory)
        path = directory / "manifest.json"
        _need_format(m, ARTIFACT_FORMAT, path, "not a sharktank artifact manifest")
        for key, kind in _FIELDS.items():
            _need(isinstance(m.get(key), kind) and not isinstance(m.get(key), bool), path, f"field {key!r} is missing or not {kind.__name__}")
        _need(m["device_count"] >= 1 and isinstance(m["parameters"].get("files"), dict), path, "device_count must be >= 1 and parameters.files an object")
        _need(isinstance(m.get("compile"), (dict, type(None))), path, "field 'compile' must be an object or null")
        _need(isinstance(m["model"].get("config"), dict) and isinstance(m["model"].get("dtype"), str), path, "model.config and model.dtype are required")
        _need(bool(m["functions"]), path, "exports no functions")
        # Every reader (run, compile, inspect) may open these: none may lead outside the directory.
        for name in (m["module"].get("mlir"), m["module"].get("vmfb"), *m["parameters"]["files"]):
            if name is not None:
                path_inside(directory, name, path)
        functions = {name: _function(name, raw, path) for name, raw in m["functions"].items()}
        return cls(directory, m, functions)

    # --- functions ---------------------------------------------------------------------------
    def find(self, kind: str, batch: int) -> FunctionSpec | None:
        """``kind``'s function for batch size ``batch``, or None when it was not exported."""
        return find_function(self.functions, kind, batch)

    def smallest(self, kind: str) -> FunctionSpec:
        """``kind``'s function of the smallest exported batch size."""
        specs = [f for f in self.functions.values() if f.kind == kind]
        if not specs:
            raise ArtifactError(f"{self.directory}: exports no {kind} function")
        return min(specs, key=lambda f: f.batch_size)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        # The paged prefill is one sequence whatever the batch: it names no batch size.
        return tuple(sorted({f.batch_size for f in self.functions.values() if f.kind != "prefill_paged"}))

    @property
    def max_seq_len(self) -> int:
        """The shortest cache any function has (every function has the same today)."""
        return min(f.max_seq_len for f in self.functions.values())

    # --- what the model and the build are ----------------------------------------------------
    @property
    def path(self) -> Path:
        return self.directory / "manifest.json"

    @property
    def device_count(self) -> int:
        return self.data["device_count"]

    @property
    def source(self) -> str:
        return self.data["model"].get("source", "")

    @property
    def config(self) -> dict:
        return self.data["model"]["config"]

    @property
    def dtype(self) -> str:
        return self.data["model"]["dtype"]

    @property
    def quantized(self) -> bool:
        return bool(self.data["model"].get("quantized"))

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def experts(self) -> str | None:
        """How a mixture of experts is split over each tensor-parallel group: ``"ffn"`` (each
        expert as the dense FFN) or ``"experts"`` (expert parallelism); None for a dense model."""
        return self.data["model"].get("experts")

    @property
    def dense(self) -> str:
        """How the weights other than the experts are placed on each group: ``"split"``
        (tensor parallelism) or ``"replicated"`` (expert parallelism alone)."""
        return self.data["model"].get("dense", "split")

    @property
    def parallel(self) -> dict:
        return self.data["parallel"]

    @property
    def module(self) -> dict:
        return self.data["module"]

    @property
    def parameters(self) -> dict:
        return self.data["parameters"]

    @property
    def compile(self) -> dict | None:
        return self.data.get("compile")

    @property
    def versions(self) -> dict:
        return self.data["versions"]

    @property
    def transfers(self) -> dict:
        """Transfers between devices per exported function (counted in the MLIR)."""
        return self.data.get("transfers") or {}

    @property
    def export_seconds(self) -> float | None:
        return self.data.get("export_seconds")

    @property
    def tokenizer(self) -> dict | None:
        """The tokenizer entry (see ``sharktank.text.load_tokenizer``), or None without one."""
        return self.data.get("tokenizer")

    @property
    def host(self) -> dict | None:
        """One host's role (host, hosts, stages, first, last) when this is a host's program."""
        h = self.data.get("host")
        return h if isinstance(h, dict) else None


@dataclass(frozen=True)
class HostEntry:
    """One host of a multi-host artifact: its program's directory and manifest sha256."""

    host: int
    dir: str
    manifest_sha256: str
    data: dict


@dataclass(frozen=True)
class HostsManifest:
    """A ``sharktank.hosts`` manifest, checked (hosts 0..N-1, N >= 2, directories inside)."""

    directory: Path
    data: dict
    hosts: tuple[HostEntry, ...]

    @classmethod
    def read(cls, directory: str | Path) -> "HostsManifest":
        directory = Path(directory)
        _, m = _load_json(directory, made_by="sharktank export --hosts")
        return cls.from_dict(m, directory)

    @classmethod
    def from_dict(cls, m: Any, directory: str | Path) -> "HostsManifest":
        directory = Path(directory)
        path = directory / "manifest.json"
        _need_format(m, HOSTS_FORMAT, path, "not a multi-host artifact", f", expected {HOSTS_FORMAT!r}); run a one-host artifact without --distributed")
        hosts = m.get("hosts")
        ok = isinstance(hosts, list) and len(hosts) >= 2 and all(isinstance(h, dict) for h in hosts)
        _need(ok and [h.get("host") for h in hosts] == list(range(len(hosts))), path, "'hosts' must list hosts 0..N-1 (N >= 2)")
        entries = []
        for h in hosts:
            _need(isinstance(h.get("dir"), str) and isinstance(h.get("manifest_sha256"), str), path, f"host {h['host']} needs 'dir' and 'manifest_sha256'")
            path_inside(directory, h["dir"], path)
            entries.append(HostEntry(h["host"], h["dir"], h["manifest_sha256"], h))
        _need(isinstance(m.get("model"), dict) and isinstance(m.get("boundary"), dict), path, "fields 'model' and 'boundary' are required")
        return cls(directory, m, tuple(entries))

    def host_dir(self, host: int) -> Path:
        return self.directory / self.hosts[host].dir

    @property
    def export_seconds(self) -> float | None:
        return self.data.get("export_seconds")

    @property
    def dtype(self) -> str:
        return self.data["model"]["dtype"]

    @property
    def vocab_size(self) -> int:
        return self.data["model"]["config"]["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.data["boundary"]["hidden_size"]


def read_any(directory: str | Path) -> Manifest | HostsManifest:
    """Whichever manifest ``directory`` holds (one program or several hosts)."""
    directory = Path(directory)
    _, m = _load_json(directory)
    if isinstance(m, dict) and m.get("format") == HOSTS_FORMAT:
        return HostsManifest.from_dict(m, directory)
    return Manifest.from_dict(m, directory)


def parameter_bytes_per_device(m: Manifest | HostsManifest) -> dict[int, int]:
    """Parameter bytes each (global) device holds: from the archives a one-program manifest
    names, or summed over every host's program of a multi-host one (its local devices mapped
    back to global ones)."""
    if isinstance(m, Manifest):
        return {f["device"]: f["size"] for f in m.parameters["files"].values()}
    sizes: dict[int, int] = {}
    for h in m.hosts:
        local = {loc: glob for glob, loc in h.data["devices"]}
        for f in Manifest.read(m.host_dir(h.host)).parameters["files"].values():
            sizes[local[f["device"]]] = sizes.get(local[f["device"]], 0) + f["size"]
    return sizes

