"""IREE parameter archives: dtype-preserving round trips, atomic writes, damaged files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharktank.weights import WeightsError, irpa_keys, load_irpa, load_irpa_metadata, save_irpa
from sharktank.weights._files import atomic_file

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool
]


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    t = torch.randn(shape) * 50
    return (t > 0) if dtype == torch.bool else t.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_keeps_dtype_shape_and_bits(tmp_path, dtype):
    tensors = {
        "w": _sample(dtype, (3, 5)),
        "scalar": _sample(dtype, ()),
        "empty": _sample(dtype, (0, 4)),
        "strided": _sample(dtype, (4, 6))[:, ::2],  # not contiguous
    }
    save_irpa(tmp_path / "a.irpa", tensors)
    loaded = load_irpa(tmp_path / "a.irpa")
    assert list(loaded) == list(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == dtype and loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name], t), name


def test_metadata_and_keys(tmp_path):
    save_irpa(tmp_path / "a.irpa", {"b": torch.ones(2), "a": torch.zeros(3)}, metadata={"model": "tiny", "layers": [1, 2]})
    assert load_irpa_metadata(tmp_path / "a.irpa") == {"model": "tiny", "layers": [1, 2]}
    assert irpa_keys(tmp_path / "a.irpa") == ["b", "a"]
    assert set(load_irpa(tmp_path / "a.irpa")) == {"a", "b"}
    save_irpa(tmp_path / "b.irpa", {"x": torch.ones(1)})
    assert load_irpa_metadata(tmp_path / "b.irpa") is None


def test_archive_is_readable_by_iree_runtime_io(tmp_path):
    from iree.runtime import ParameterIndex
    from iree.runtime.io import parameter_index_entry_as_numpy_ndarray

    t = torch.randn(3, 4)
    save_irpa(tmp_path / "a.irpa", {"t": t})
    index = ParameterIndex()
    index.load(str(tmp_path / "a.irpa"))
    (name, entry), = index.items()
    assert name == "t" and np.array_equal(parameter_index_entry_as_numpy_ndarray(entry), t.numpy())


def test_save_rejects_non_tensors_and_leaves_existing_file(tmp_path):
    save_irpa(tmp_path / "a.irpa", {"x": torch.ones(2)})
    before = (tmp_path / "a.irpa").read_bytes()
    with pytest.raises(TypeError, match="'y'"):
        save_irpa(tmp_path / "a.irpa", {"x": torch.zeros(2), "y": np.zeros(2)})
    assert (tmp_path / "a.irpa").read_bytes() == before and len(list(tmp_path.iterdir())) == 1


def test_atomic_file_leaves_target_untouched_on_failure(tmp_path):
    target = tmp_path / "a.irpa"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_bytes(b"half-written")
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("damage", ["truncated", "zero_length", "wrong_magic", "missing"])
def test_damaged_archive(tmp_path, damage):
    file = tmp_path / "a.irpa"
    save_irpa(file, {"big": torch.randn(4096), "small": torch.ones(3)})
    data = file.read_bytes()
    if damage == "missing":
        file.unlink()
    else:
        file.write_bytes({"truncated": data[: len(data) // 2], "zero_length": b"", "wrong_magic": b"XPRA" + data[4:]}[damage])
    for read in (load_irpa, irpa_keys, load_irpa_metadata):
        with pytest.raises(WeightsError) as err:
            read(file)
        assert err.value.path == str(file) and "a.irpa" in str(err.value)


def test_entry_without_tensor_metadata(tmp_path):
    from iree.runtime import ParameterIndex

    index = ParameterIndex()
    index.add_buffer("raw", np.zeros(8, np.uint8))
    index.create_archive_file(str(tmp_path / "raw.irpa"))
    with pytest.raises(WeightsError, match="raw.irpa.*'raw'.*does not describe a tensor"):
        load_irpa(tmp_path / "raw.irpa")
