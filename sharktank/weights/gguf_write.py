"""Writing GGUF files, model-agnostic: metadata key/values, then tensors one at a time.

A tensor to write is an *entry* ``(GGUF name, spec, produce)``: ``spec`` is
``(array shape, numpy dtype, bytes, ggml type name)`` as :func:`tensor_spec` gives it and
``produce()`` returns that array. The header is written from the specs first and each
``produce()`` is called once, in order, afterwards, so one tensor is in memory at a time.
:func:`quantized_entries` makes the entries of a quantized file with the gguf package's own
quantizers. Which names, keys and row orders a model's file uses is the model's business.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Collection, Iterable

import numpy as np
import torch

from ..types import LAYOUTS, QuantizedTensor, ShardedTensor
from ._files import atomic_file
from .errors import WeightsError
from .gguf_read import GGML_TYPES

__all__ = ["QUANTIZE_TO", "Entry", "tensor_entry", "tensor_spec", "tensor_array", "quantized_entries", "write_gguf"]

Entry = tuple[str, tuple, Callable[[], np.ndarray]]

# Types ``quantized_entries`` makes with the gguf package's own quantizers (it has none for K-quants).
QUANTIZE_TO = {"q8_0": "Q8_0", "q4_0": "Q4_0"}


def tensor_spec(t: torch.Tensor | QuantizedTensor) -> tuple:
    """(array shape, numpy dtype, bytes, ggml type name) of the array GGUF stores for ``t``."""
    if isinstance(t, QuantizedTensor):  # the blocks of each row as one byte row (of a 2-D or 3-D array)
        rows = tuple(t.shape[:-1]) if t.ndim > 1 else (1,)
        return (*rows, t.nbytes // int(np.prod(rows))), np.uint8, t.nbytes, t.layout.name
    np_dtype = np.uint16 if t.dtype == torch.bfloat16 else {torch.float32: np.float32, torch.float16: np.float16}[t.dtype]
    return tuple(t.shape), np_dtype, t.numel() * t.element_size(), GGML_TYPES[t.dtype]


def tensor_array(t: torch.Tensor | QuantizedTensor) -> np.ndarray:
    """The array GGUF stores for ``t`` (a quantized tensor's blocks, bf16 as its uint16 bits)."""
    if isinstance(t, QuantizedTensor):
        return t.blocks.reshape(tensor_spec(t)[0]).contiguous().numpy()
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def tensor_entry(name: str, t, produce: Callable[[], Any], *, path, label: str | None = None) -> Entry:
    """The entry writing ``t`` (a plain f32/f16/bf16 tensor or :class:`QuantizedTensor`) as
    ``name``; ``produce()`` returns the tensor to store (``t`` itself, or ``t`` reordered).
    Anything else raises :class:`WeightsError` naming ``label`` (default ``name``)."""
    if isinstance(t, ShardedTensor) or not (isinstance(t, QuantizedTensor) or t.dtype in GGML_TYPES):
        what = type(t).__name__ if isinstance(t, ShardedTensor) else t.dtype
        raise WeightsError(f"cannot save {what}; GGUF takes plain f32, f16 or bf16 tensors or QuantizedTensor ({', '.join(LAYOUTS)})", path=path, tensor=label or name)
    return name, tensor_spec(t), lambda: tensor_array(produce())


def quantized_entries(
    tensors: Iterable[tuple[str, str, Any, Callable[[], Any]]], to: str, *, path, progress=lambda msg: None, keep: Collection[str] = ()
) -> tuple[list[Entry], dict[str, int]]:
    """Entries of a GGUF whose 2-D (and 3-D: stacked experts) weights are quantized to ``to`` (a :data:`QUANTIZE_TO` key) by
    ``gguf.quants.quantize``, and the count of tensors by ggml type. ``tensors`` are
    ``(GGUF name, label, placeholder, read)``: ``read()`` gives the tensor as the file stores
    it (rows in the file's order). Norms and biases (1-D) become float32; a weight whose
    rows are not whole blocks, or that is quantized already, is written as it is, and so are
    the GGUF names in ``keep``."""
    if to not in QUANTIZE_TO:
        raise ValueError(f"cannot quantize to {to!r}; supported: {', '.join(QUANTIZE_TO)}")
    kind = QUANTIZE_TO[to]
    layout = LAYOUTS[kind]
    tensors = list(tensors)
    entries, counts = [], {}
    for i, (name, label, t, read) in enumerate(tensors):
        if name in keep:
            entry = (name, tensor_spec(t), lambda read=read: tensor_array(read()))
        elif not isinstance(t, QuantizedTensor) and t.ndim >= 2 and t.shape[-1] % layout.block_size == 0:  # 3-D: stacked experts
            row_bytes = t.shape[-1] // layout.block_size * layout.block_bytes
            spec = ((*t.shape[:-1], row_bytes), np.uint8, t.shape[:-1].numel() * row_bytes, kind)
            msg = f"quantized {i + 1}/{len(tensors)}: {label}"
            entry = (name, spec, lambda read=read, msg=msg: _quantize(read().float(), kind, lambda: progress(msg)))
        elif not isinstance(t, QuantizedTensor) and t.ndim < 2:
            # The spec comes from the shape alone: the placeholder is never converted (that would touch it).
            entry = (name, (tuple(t.shape), np.float32, t.numel() * 4, "F32"), lambda read=read: tensor_array(read().float()))
        elif isinstance(t, QuantizedTensor) or t.dtype in GGML_TYPES:  # kept as it is
            entry = (name, tensor_spec(t), lambda read=read: tensor_array(read()))
        else:
            raise WeightsError(f"cannot store {t.dtype} in GGUF", path=path, tensor=label)
        counts[entry[1][3]] = counts.get(entry[1][3], 0) + 1
        entries.append(entry)
    return entries, counts


def _quantize(rows: torch.Tensor, kind: str, announce: Callable[[], None]) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    announce()
    return quantize(rows.contiguous().numpy(), GGMLQuantizationType[kind])


def write_gguf(path: str | os.PathLike, architecture: str, metadata: dict[str, tuple[str, Any]], entries: Iterable[Entry]) -> None:
    """Write a GGUF of ``architecture`` with ``metadata`` (key -> (GGUFWriter value kind such as
    ``uint32``, value)) and the tensors of ``entries``, next to ``path`` and renamed into place.
    A ``produce()`` whose array disagrees with its spec raises :class:`WeightsError`."""
    from gguf import GGMLQuantizationType, GGUFWriter

    entries = list(entries)
    with atomic_file(path) as tmp:
        writer = GGUFWriter(str(tmp), architecture)
        for key, (kind, value) in metadata.items():
            getattr(writer, f"add_{kind}")(key, value)
        for name, (shape, np_dtype, nbytes, kind), _ in entries:
            writer.add_tensor_info(name, shape, np.dtype(np_dtype), nbytes, raw_dtype=GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, (shape, np_dtype, nbytes, _), produce in entries:
            array = produce()
            if array.nbytes != nbytes or array.dtype != np.dtype(np_dtype):
                raise WeightsError(f"produced {array.dtype} of {array.nbytes} bytes, declared {np.dtype(np_dtype)} of {nbytes}", path=path, tensor=name)
            writer.write_tensor_data(array)
        writer.close()
