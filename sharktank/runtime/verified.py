"""A record of the artifact files whose sha256 was checked, so unchanged files are not re-hashed.

Hashing is what makes ``run`` refuse a changed or corrupt file, but re-reading gigabytes
of parameters on every start costs seconds. After a file's sha256 matched its manifest,
its identity is recorded: device, inode, size, and modification and change times in
nanoseconds. Any write, truncation, rename over it or ``chmod`` moves the change time
(``st_ctime``), which no program can set back, so a file whose identity is unchanged
still holds the bytes that were hashed; anything else is hashed again.

Records live outside the artifact (it may be read-only), one small JSON file per artifact
under ``$SHARKTANK_CACHE/verified`` (default ``~/.cache/sharktank/verified``). A
missing, unreadable or foreign record only means hashing again. ``SHARKTANK_VERIFY=always``
turns the record off.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..weights._files import atomic_file, sha256_file

__all__ = ["VerifiedFiles", "cache_dir"]


def cache_dir() -> Path:
    base = os.environ.get("SHARKTANK_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "sharktank"


def _identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class VerifiedFiles:
    """The verification record of one artifact directory."""

    def __init__(self, directory: Path):
        self.directory = Path(directory).resolve()
        key = hashlib.sha256(str(self.directory).encode()).hexdigest()[:24]
        self.path = cache_dir() / "verified" / f"{key}.json"
        self.enabled = os.environ.get("SHARKTANK_VERIFY", "") != "always"
        self.hashed: list[str] = []  # files hashed by this object (tests count them)
        self._records = self._load() if self.enabled else {}
        self._changed = False

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("directory") != str(self.directory) or not isinstance(data.get("files"), dict):
            return {}
        return data["files"]

    def matches(self, path: Path, sha256: str) -> bool:
        """Whether ``path`` holds bytes with this ``sha256``: from the record when the file is
        unchanged since it was verified, else by hashing it (and recording a match)."""
        name = str(Path(path).resolve())
        identity = _identity(path)
        rec = self._records.get(name)
        if rec is not None and rec.get("identity") == identity and rec.get("sha256") == sha256:
            return True
        self.hashed.append(name)
        ok = sha256_file(path) == sha256
        if ok and self.enabled and _identity(path) == identity:  # not changed while hashing
            self._records[name] = {"identity": identity, "sha256": sha256}
            self._changed = True
        return ok

    def save(self) -> None:
        """Write the record (best effort: a read-only home only costs a re-hash next time)."""
        if not (self.enabled and self._changed):
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.path) as tmp:
                tmp.write_text(json.dumps({"directory": str(self.directory), "files": self._records}))
        except OSError:
            pass
        self._changed = False
