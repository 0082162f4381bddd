"""The record of verified files: an unchanged artifact is not re-hashed; a changed one is refused."""

from __future__ import annotations

import os
import shutil

import pytest

from sharktank.runtime import CompiledModel
from sharktank.runtime.compiled import ArtifactError
from sharktank.runtime.verified import VerifiedFiles


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    out = tmp_path_factory.mktemp("verified") / "art"
    export_artifact(load_model("toy-llama", tp=2), out, source="toy-llama", max_seq_len=16, functions=("prefill", "decode"))
    return out


def _copy(artifact, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(artifact, out)
    return out


def _hashed(directory) -> list[str]:
    return sorted(os.path.basename(p) for p in CompiledModel(directory).verified.hashed)


def test_second_load_hashes_nothing(artifact, tmp_path):
    d = _copy(artifact, tmp_path)
    assert _hashed(d) == ["device_0.irpa", "device_1.irpa", "model.vmfb"]
    assert _hashed(d) == []


@pytest.mark.parametrize("change", ["same size, times restored", "truncated", "replaced by a copy"])
def test_changed_archive_is_hashed_again_and_refused(artifact, tmp_path, change):
    d = _copy(artifact, tmp_path)
    CompiledModel(d)  # verified and recorded
    path = d / "device_1.irpa"
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    if change == "same size, times restored":
        data[-1] ^= 0xFF
        path.write_bytes(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime as before; ctime moves
    elif change == "truncated":
        path.write_bytes(data[:-4096])
    else:
        data[-1] ^= 0xFF
        other = d / "other"
        other.write_bytes(data)
        os.replace(other, path)
    with pytest.raises(ArtifactError, match=r"device_1\.irpa: sha256 does not match"):
        CompiledModel(d)


def test_record_of_another_directory_is_not_used(artifact, tmp_path):
    # Copies of one artifact share nothing: each is verified on its own first load.
    a, b = _copy(artifact, tmp_path / "a"), _copy(artifact, tmp_path / "b")
    assert len(_hashed(a)) == 3
    assert len(_hashed(b)) == 3


def test_verify_always_turns_the_record_off(artifact, tmp_path, monkeypatch):
    d = _copy(artifact, tmp_path)
    CompiledModel(d)
    monkeypatch.setenv("SHARKTANK_VERIFY", "always")
    assert len(_hashed(d)) == 3


def test_unreadable_record_means_hashing_again(artifact, tmp_path):
    d = _copy(artifact, tmp_path)
    CompiledModel(d)
    VerifiedFiles(d).path.write_text("{not json")
    assert len(_hashed(d)) == 3
    assert _hashed(d) == []
