"""A directory of per-device irpa archives plus a JSON manifest, for sharded thetas.

Layout of ``save_sharded(directory, ...)``::

    directory/
      theta.json       manifest (below)
      device_<d>.irpa  the shards that live on logical device d, keyed by tensor name
      plain.irpa       the unsharded tensors (absent when there are none)

``theta.json``::

    {"format": "sharktank.theta", "version": 1,
     "config": {...the model config, as given...},
     "archives": {"device_5.irpa": {"size": 1234, "sha256": "..."}, ...},
     "tensors": {"<name>": {"kind": "split" | "replicated" | "unreduced" | "plain",
                            "shard_dim": 0 | null, "devices": [5, 2] | null,
                            "pinned": true | null, "dtype": "float32", "shape": [..],
                            "name": "<ShardedTensor.name>" | null,
                            "layout": "Q8_0" (only for quantized shards, stored as their blocks),
                            "shards": [{"file": "device_5.irpa", "key": "<name>"}, ...]}}}

The format knows no model: the config is a JSON object, stored and returned as given
(``sharktank.models.save_theta`` stores a ``LlamaConfig``). Devices are distinct within a
tensor, so the tensor name is a unique key in each device file; a replicated tensor is
stored once per device. Tensors keep their theta order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..types import LAYOUTS, QuantizedTensor, ReplicatedTensor, ShardedTensor, SplitPrimitiveTensor, UnreducedTensor, stored
from ._files import atomic_dir, atomic_file, resolve_inside, sha256_file
from .errors import WeightsError
from .irpa import _dtype_name, load_irpa, save_irpa
from .theta import Theta

__all__ = ["save_sharded", "load_sharded", "device_archive", "MANIFEST", "PLAIN_ARCHIVE"]

MANIFEST = "theta.json"
PLAIN_ARCHIVE = "plain.irpa"
FORMAT, VERSION = "sharktank.theta", 1
_KINDS = {SplitPrimitiveTensor: "split", ReplicatedTensor: "replicated", UnreducedTensor: "unreduced"}


def device_archive(device: int) -> str:
    """The archive holding the shards of logical ``device``."""
    return f"device_{device}.irpa"


def save_sharded(directory: str | os.PathLike, config: Mapping[str, Any], theta: Theta) -> None:
    """Save ``config`` (a JSON object) and a possibly sharded ``theta`` as one archive per
    device plus a manifest.

    The directory is built beside ``directory`` and renamed into place once complete. An
    existing ``directory`` is replaced only if it is empty or holds a ``theta.json``
    (FileExistsError otherwise), so unrelated files are never deleted.
    """
    archives: dict[str, dict[str, torch.Tensor]] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, t in theta.items():
        entries[name] = _describe(name, t)
        for shard, loc in zip(t.shards if isinstance(t, ShardedTensor) else (t,), entries[name]["shards"]):
            # A quantized shard is stored as its blocks; the entry names the layout.
            archives.setdefault(loc["file"], {})[loc["key"]] = stored(shard)
    with atomic_dir(directory, may_replace=_is_theta_dir, marker=MANIFEST) as tmp:
        files = {}
        for file, tensors in sorted(archives.items()):
            save_irpa(tmp / file, tensors)
            files[file] = {"size": (tmp / file).stat().st_size, "sha256": sha256_file(tmp / file)}
        manifest = {"format": FORMAT, "version": VERSION, "config": dict(config), "archives": files, "tensors": entries}
        with atomic_file(tmp / MANIFEST) as manifest_tmp:  # for its fsync
            manifest_tmp.write_text(json.dumps(manifest, indent=1))


def load_sharded(directory: str | os.PathLike, config_from: Callable[[dict[str, Any]], Any] = dict) -> tuple[Any, Theta]:
    """Load what :func:`save_sharded` wrote, checking sizes, checksums, paths and shapes, as
    ``(config_from(manifest config), theta)``.

    Any problem raises :class:`WeightsError` naming the file (and tensor) concerned; a
    ``config_from`` raising TypeError or ValueError is reported as a bad config.
    """
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    manifest = _read_manifest(manifest_path)
    try:
        config = config_from(manifest["config"])
    except (TypeError, ValueError) as e:
        raise WeightsError(f"bad config: {e}", path=manifest_path) from None
    contents = {}
    for file, info in manifest["archives"].items():
        full = resolve_inside(directory, file, manifest=manifest_path)
        _verify(full, info)
        contents[file] = load_irpa(full)
    tensors = {}
    for name, entry in manifest["tensors"].items():
        try:
            tensors[name] = _restore(name, entry, contents, directory, manifest_path)
        except WeightsError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"bad manifest entry: {type(e).__name__}: {e}", path=manifest_path, tensor=name) from None
    return config, Theta(tensors)


def _describe(name: str, t) -> dict[str, Any]:
    entry = _describe_placement(name, t)
    first = t.shards[0] if isinstance(t, ShardedTensor) else t
    if isinstance(first, QuantizedTensor):
        entry["layout"] = first.layout.name
    return entry


def _describe_placement(name: str, t) -> dict[str, Any]:
    if isinstance(t, (torch.Tensor, QuantizedTensor)):
        return {
            "kind": "plain", "shard_dim": None, "devices": None, "pinned": None, "name": None,
            "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
            "shards": [{"file": PLAIN_ARCHIVE, "key": name}],
        }
    kind = _KINDS.get(type(t))
    if kind is None:
        raise TypeError(f"cannot save {type(t).__name__} {name!r}; known kinds: {sorted(_KINDS.values())}")
    return {
        "kind": kind, "shard_dim": t.shard_dim if kind == "split" else None,
        "devices": list(t.devices), "pinned": t.pinned, "name": t.name,
        "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
        "shards": [{"file": device_archive(d), "key": name} for d in t.devices],
    }


def _restore(name: str, entry: dict[str, Any], contents, directory: Path, manifest_path: Path):
    shards = []
    for loc in entry["shards"]:
        resolve_inside(directory, loc["file"], manifest=manifest_path)
        if loc["file"] not in contents:
            msg = f"shard file {loc['file']!r} is not among the manifest's archives"
            raise WeightsError(msg, path=manifest_path, tensor=name)
        archive = contents[loc["file"]]
        if loc["key"] not in archive:
            raise WeightsError(f"no entry {loc['key']!r}", path=directory / loc["file"], tensor=name)
        shards.append(archive[loc["key"]])
    if entry.get("layout") is not None:  # blocks [..., n_blocks, block_bytes] of a quantized tensor
        layout = LAYOUTS[entry["layout"]]
        dtype = getattr(torch, entry["dtype"])
        shards = [QuantizedTensor(layout, (*b.shape[:-2], b.shape[-2] * layout.block_size), b, dtype=dtype, name=name) for b in shards]
    kind = entry["kind"]
    placed = dict(ts=shards, devices=entry["devices"], pinned=entry["pinned"], name=entry["name"])
    if kind == "plain":
        if len(shards) != 1:
            raise ValueError(f"a plain tensor has one shard, found {len(shards)}")
        t = shards[0]
    elif kind == "split":
        t = SplitPrimitiveTensor(shard_dim=entry["shard_dim"], **placed)
    elif kind == "replicated":
        t = ReplicatedTensor(**placed)
    elif kind == "unreduced":
        t = UnreducedTensor(**placed)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if list(t.shape) != entry["shape"] or _dtype_name(t.dtype) != entry["dtype"]:
        raise WeightsError(
            f"shards make {_dtype_name(t.dtype)} {list(t.shape)}, the manifest says {entry['dtype']} {entry['shape']}",
            path=manifest_path, tensor=name,
        )
    return t


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise WeightsError("manifest not found", path=path)
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise WeightsError(f"manifest is not JSON: {e}", path=path) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise WeightsError(f"not a {FORMAT} v{VERSION} manifest", path=path)
    for key in ("config", "archives", "tensors"):
        if not isinstance(manifest.get(key), dict):
            raise WeightsError(f"manifest field {key!r} is missing or not an object", path=path)
    return manifest


def _verify(file: Path, info: Any) -> None:
    if not file.is_file():
        raise WeightsError("archive listed in the manifest is missing", path=file)
    if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
        raise WeightsError("manifest entry lacks size/sha256", path=file)
    size = file.stat().st_size
    if size != info.get("size"):
        raise WeightsError(f"size {size} bytes, the manifest says {info.get('size')}", path=file)
    digest = sha256_file(file)
    if digest != info["sha256"]:
        raise WeightsError(f"sha256 {digest} does not match the manifest's {info['sha256']}", path=file)


def _is_theta_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file() or not any(path.iterdir())

