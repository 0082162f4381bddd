"""Watching what a loader touches: files outside a directory (inotify) and pickle use.

``Watch`` uses Linux inotify through ctypes, so it sees every open, read, write and create by
this process and its C/Rust libraries (IREE's parameter index, safetensors), not only Python's
``open``. ``no_pickle`` records any unpickling (``pickle``, ``torch.load``) while it is active.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import pickle
import struct
import sys
from pathlib import Path
from typing import Iterator

__all__ = ["Watch", "inotify_available", "no_pickle", "tree_state"]

_IN = {
    "ACCESS": 0x1, "MODIFY": 0x2, "ATTRIB": 0x4, "CLOSE_WRITE": 0x8, "CLOSE_NOWRITE": 0x10,
    "OPEN": 0x20, "MOVED_FROM": 0x40, "MOVED_TO": 0x80, "CREATE": 0x100, "DELETE": 0x200,
}
_MASK = sum(_IN[k] for k in ("ACCESS", "MODIFY", "OPEN", "MOVED_TO", "CREATE", "DELETE", "CLOSE_WRITE", "ATTRIB"))
_IN_NONBLOCK = 0o4000
_EVENT = struct.Struct("iIII")

_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def inotify_available() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        fd = _lib().inotify_init1(_IN_NONBLOCK)
    except (OSError, AttributeError):
        return False
    if fd < 0:
        return False
    os.close(fd)
    return True


class Watch:
    """Record every access to ``paths`` (files, or directories and the files directly in them)."""

    def __init__(self, *paths: Path):
        lib = _lib()
        self.fd = lib.inotify_init1(_IN_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.paths: dict[int, Path] = {}
        for p in paths:
            wd = lib.inotify_add_watch(self.fd, os.fsencode(p), _MASK)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch({p}) failed")
            self.paths[wd] = Path(p)

    def events(self) -> list[str]:
        """``"<path>: OPEN|ACCESS"`` for each event since the last call."""
        out = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(data):
                wd, mask, _, size = _EVENT.unpack_from(data, i)
                name = data[i + _EVENT.size : i + _EVENT.size + size].rstrip(b"\0").decode()
                i += _EVENT.size + size
                path = self.paths.get(wd, Path("?")) / name if name else self.paths.get(wd, Path("?"))
                out.append(f"{path}: {'|'.join(k for k, v in _IN.items() if mask & v)}")

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_pickle_calls: list[str] = []
_active = [False]  # the audit hook stays installed (they cannot be removed) but records only while active
_hook_installed = False


def _audit(event: str, args) -> None:
    if event == "pickle.find_class" and _active[0]:
        _pickle_calls.append(f"pickle.find_class{args}")


@contextlib.contextmanager
def no_pickle() -> Iterator[list[str]]:
    """Yield a list that collects every unpickling attempt made inside the block.

    The entry points are replaced by recorders that raise (so nothing is unpickled), and an
    audit hook catches unpicklers reached another way (``pickle.find_class`` events).
    """
    import torch

    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)
        _hook_installed = True
    _pickle_calls.clear()

    def recorder(name):
        def call(*args, **kwargs):
            _pickle_calls.append(name)
            raise RuntimeError(f"{name} called while loading (no pickle allowed)")

        return call

    saved = {(pickle, "load"): pickle.load, (pickle, "loads"): pickle.loads, (pickle, "Unpickler"): pickle.Unpickler, (torch, "load"): torch.load}
    for (mod, name) in saved:
        setattr(mod, name, recorder(f"{mod.__name__}.{name}"))
    _active[0] = True
    try:
        yield _pickle_calls
    finally:
        _active[0] = False
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """``relative path -> (size, mtime_ns)`` of every file under ``root`` (symlinks not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if not p.is_dir() else 0, st.st_mtime_ns if not p.is_dir() else 0)
    return out
