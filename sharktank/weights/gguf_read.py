"""Reading GGUF files, model-agnostic: metadata key/values and tensor infos by GGUF name.

GGUF lists dims fastest-first (ggml ``ne``); the ``gguf`` library reverses them to numpy
order, which is the torch order used here. Tensors are read with positioned reads, nothing
left mapped. f32, f16 and bf16 tensors read as torch tensors, the block layouts of
:data:`sharktank.types.LAYOUTS` as :class:`QuantizedTensor` (the file's blocks, unchanged).
What the names and keys mean is the model's business (``sharktank.models.llama``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

import numpy as np
import torch

from ..types import LAYOUTS, QuantizedTensor
from .errors import WeightsError

__all__ = ["GGML_TYPES", "GgufFile", "GgufTensor", "read_gguf"]

# torch dtype <-> ggml type; numpy has no bfloat16, so bf16 travels as its uint16 bits.
GGML_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_SUPPORTED = ", ".join([*GGML_TYPES.values(), *LAYOUTS])


@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor's data is in a GGUF file, and what it is."""

    name: str  # as the file names it
    shape: tuple[int, ...]
    dtype: torch.dtype  # a quantized tensor's: float32, what it dequantizes to
    offset: int  # of the data in the file
    nbytes: int
    layout: str | None = None  # the GGML block layout of a quantized tensor

    @property
    def spec(self) -> tuple:
        """``(shape, dtype)``, or ``(shape, dtype, layout)`` for blocks: a WeightSource spec."""
        return (self.shape, self.dtype) if self.layout is None else (self.shape, self.dtype, self.layout)

    def read(self, path) -> torch.Tensor | QuantizedTensor:
        """The tensor's data, read from ``path`` into fresh memory."""
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), self.nbytes, self.offset)
        if len(data) != self.nbytes:
            raise WeightsError(f"file ends {self.nbytes - len(data)} bytes into this tensor", path=path, tensor=self.name)
        if self.layout is not None:  # kept as the blocks the file stores
            blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return QuantizedTensor(self.layout, self.shape, blocks, dtype=self.dtype, name=self.name)
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(self.shape)


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's metadata (key -> decoded value) and tensors (GGUF name -> info, in file order)."""

    path: str
    fields: dict[str, Any]
    tensors: dict[str, GgufTensor]

    @property
    def architecture(self) -> str:
        """``general.architecture``: the model family, and the prefix of its metadata keys."""
        return self.fields["general.architecture"]


def read_gguf(path: str | os.PathLike, *, architectures: Collection[str]) -> GgufFile:
    """The metadata and tensor infos of the GGUF file ``path``, whose ``general.architecture``
    must be one of ``architectures``. A missing or damaged file, another architecture, or a
    tensor of an unsupported ggml type or inconsistent size raises :class:`WeightsError`."""
    from gguf import GGUFReader

    if not Path(path).is_file():
        raise WeightsError("GGUF file not found", path=path)
    try:
        reader = GGUFReader(path)
        # contents() decodes strings lazily: a damaged one raises UnicodeDecodeError here.
        fields = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError... by case
        raise WeightsError(f"not a readable GGUF file: {type(e).__name__}: {e}", path=path) from None
    if fields.get("general.architecture") not in architectures:
        expected = ", ".join(repr(a) for a in architectures)
        raise WeightsError(f"general.architecture is {fields.get('general.architecture')!r}, expected one of {expected}", path=path)
    tensors = {rt.name: _tensor(path, rt) for rt in reader.tensors}
    del reader  # its memory map: reads are positioned reads of the file
    return GgufFile(str(path), fields, tensors)


def _tensor(path, rt) -> GgufTensor:
    kind = rt.tensor_type.name
    shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
    count = int(np.prod(shape, dtype=np.int64))
    if kind in LAYOUTS:
        layout = LAYOUTS[kind]
        if not shape or shape[-1] % layout.block_size:
            raise WeightsError(f"{kind} shape {list(shape)}: the last dim is not a multiple of the block size {layout.block_size}", path=path, tensor=rt.name)
        want = count // layout.block_size * layout.block_bytes
        if int(rt.n_bytes) != want:
            raise WeightsError(f"{kind} {list(shape)} needs {want} bytes of blocks, the file gives {int(rt.n_bytes)}", path=path, tensor=rt.name)
        return GgufTensor(rt.name, shape, torch.float32, int(rt.data_offset), want, kind)
    dtype = {v: k for k, v in GGML_TYPES.items()}.get(kind)
    if dtype is None:
        raise WeightsError(f"ggml type {kind} is not supported (supported: {_SUPPORTED})", path=path, tensor=rt.name)
    if int(rt.n_bytes) != count * dtype.itemsize:
        raise WeightsError(f"holds {int(rt.n_bytes) // dtype.itemsize} values for shape {list(shape)}", path=path, tensor=rt.name)
    return GgufTensor(rt.name, shape, dtype, int(rt.data_offset), int(rt.n_bytes))
