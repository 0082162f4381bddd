"""File helpers shared by the formats: atomic writes, checksums, safe relative paths."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

from .errors import WeightsError

__all__ = ["atomic_file", "atomic_dir", "check_replaceable", "sha256_file", "resolve_inside"]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` in one rename.

    On any error the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    # A fresh name rather than mkstemp: the writer creates the file with the usual
    # permissions (mkstemp's 0600 would survive the rename).
    tmp_path = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp_path
        _fsync(tmp_path)
        os.replace(tmp_path, target)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, may_replace: Callable[[Path], bool], marker: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory next to ``path``; on success it takes the place of ``path``.

    An existing ``path`` is replaced only once the new directory is complete, and only if
    ``may_replace(path)`` is true (otherwise FileExistsError, before anything is written).
    The swap is two renames; between them ``path`` is briefly absent (POSIX has no
    portable atomic directory exchange), never half-written.

    ``marker``: the file that makes such a directory valid to its readers (its manifest,
    written last). A directory being deleted (the replaced one, or the new one after an
    error) loses it first, so a process killed while deleting leaves a hidden directory no
    reader takes for complete.
    """
    target = Path(path)
    check_replaceable(target, may_replace)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        check_replaceable(target, may_replace)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
            os.rename(target, old)
            os.rename(tmp, target)
            _discard(old, marker)
        else:
            os.rename(tmp, target)
    except BaseException:
        _discard(tmp, marker)
        raise


def _discard(directory: Path, marker: str | None) -> None:
    if marker is not None:
        (directory / marker).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def check_replaceable(target: Path, may_replace: Callable[[Path], bool]) -> None:
    """FileExistsError if ``target`` exists and is not a directory ``may_replace`` allows
    replacing: what :func:`atomic_dir` checks, for a writer to call before long work."""
    if target.exists() and not (target.is_dir() and may_replace(target)):
        raise FileExistsError(f"{target}: exists and is not a directory this writer may replace")


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_inside(directory: Path, rel: object, *, manifest: Path) -> Path:
    """``directory / rel`` for a relative path that stays inside ``directory``.

    Absolute paths, ``..`` components and symlinks leading outside are refused with a
    WeightsError naming ``manifest`` (the file that held the path) and the path.
    """
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts or "\\" in rel:
        raise WeightsError(f"path {rel!r} must be relative and inside {directory}", path=manifest)
    base = directory.resolve()
    full = (directory / rel).resolve()
    if not full.is_relative_to(base):
        raise WeightsError(f"path {rel!r} leads outside {directory}", path=manifest)
    return directory / rel
