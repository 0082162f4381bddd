"""Llama-family models as llama.cpp GGUF files (f32, f16, bf16 and quantized tensors), of the
architectures in :data:`.families.FAMILIES` (``llama``, ``qwen2``, ``qwen3``).

The file's names, metadata keys and q/k row order are llama.cpp's (:mod:`.gguf_names`,
:mod:`.gguf_config`); the config and theta these functions take and give are ours, in the
Hugging Face layout (:mod:`.layout`): for ``llama`` :func:`save_gguf` interleaves q/k as
llama.cpp does and :func:`load_gguf` undoes it, so a round trip returns the Hugging Face
tensors exactly. The config's ``architecture`` is the file's. The
bytes are read and written by the model-agnostic GGUF functions of ``sharktank.weights``.
The files carry no tokenizer.
"""

from __future__ import annotations

import os

from ...types import QuantizedTensor
from ...weights import Theta, WeightSource, WeightsError, quantized_entries, read_gguf, tensor_entry, write_gguf
from .config import LlamaConfig
from .gguf_config import config_from_gguf, gguf_metadata, rope_freqs_array
from .families import FAMILIES
from .gguf_names import ROPE_FREQS, interleave_rotary, is_rotary, to_gguf_name, to_hf_name
from .layout import layout_problem, llama_shapes

__all__ = ["load_gguf", "gguf_source", "save_gguf", "quantize_gguf"]


def load_gguf(path: str | os.PathLike) -> tuple[LlamaConfig, Theta]:
    """Read a GGUF file (llama, qwen2 or qwen3) into (config, theta) in the Hugging Face layout.

    Every tensor is checked against the config the metadata describes; a damaged file,
    a missing key or tensor, or a wrong shape raises :class:`WeightsError` naming the
    file (and the tensor or key).
    """
    config, source = gguf_source(path)
    return config, Theta({name: source.read(name) for name in source.names()})


def gguf_source(path: str | os.PathLike) -> tuple[LlamaConfig, WeightSource]:
    """A GGUF file's config and weights as a :class:`WeightSource`: shapes come from the
    tensor infos (checked as :func:`load_gguf` does); each tensor is read from the file
    (positioned reads, nothing left mapped) only when asked for."""
    file = read_gguf(path, architectures=FAMILIES)
    infos, rope_freqs = {}, None
    for gguf_name, info in file.tensors.items():
        if gguf_name == ROPE_FREQS:  # llama.cpp's llama3 scaling, precomputed per frequency
            rope_freqs = info
            continue
        hf_name = to_hf_name(gguf_name)
        if hf_name is None:
            raise WeightsError(f"not a tensor of the {file.architecture} architecture this loader knows", path=path, tensor=gguf_name)
        infos[hf_name] = info
    config = config_from_gguf(path, file.fields, infos, rope_freqs)
    problem = layout_problem({n: i.shape for n, i in infos.items()}, config)
    if problem is not None:
        name, reason = problem
        raise WeightsError(f"{reason} (Hugging Face name {name})", path=path, tensor=to_gguf_name(name))

    def read(name: str):
        t = interleave_rotary(name, infos[name].read(path), config, to_gguf=False)
        return t if isinstance(t, QuantizedTensor) else t.contiguous()

    specs = {n: infos[n].spec for n in llama_shapes(config)}
    # Every tensor but q and k of a llama file (reordered from llama.cpp's rotary layout) is stored as read.
    spans = {n: (str(path), infos[n].offset) for n in specs if not is_rotary(n, config)}
    return config, WeightSource(specs, read, spans=spans, label=str(path))


def save_gguf(path: str | os.PathLike, config: LlamaConfig, theta: Theta) -> None:
    """Write a Hugging Face-layout ``theta`` as a llama.cpp GGUF file of ``config.architecture``.

    ``theta`` must hold exactly the model's parameters (plain f32/f16/bf16 tensors or
    :class:`QuantizedTensor` blocks) with the shapes ``config`` implies. The file is written
    next to ``path`` and renamed into place.
    """
    problem = layout_problem({n: t.shape for n, t in theta.items()}, config)
    if problem is not None:
        raise WeightsError(f"cannot save: {problem[1]}", path=path, tensor=problem[0])
    entries = [
        tensor_entry(to_gguf_name(name), theta[name], lambda name=name: interleave_rotary(name, theta[name], config, to_gguf=True), path=path, label=name)
        for name in llama_shapes(config)
    ]
    write_entries(path, config, entries)


def quantize_gguf(path: str | os.PathLike, config: LlamaConfig, source: WeightSource, *, to: str, progress=lambda msg: None) -> dict[str, int]:
    """Write ``source`` (a :class:`WeightSource` in the Hugging Face layout) as a GGUF whose 2-D
    weights and 3-D stacked experts are quantized to ``to`` (``q8_0`` or ``q4_0``) by
    ``gguf.quants.quantize``, one tensor in memory at a time. Norms and biases stay float32; a
    weight whose rows are not whole blocks, or that is quantized already, is written as it is,
    and so are MoE routers (``ffn_gate_inp``: llama.cpp keeps them unquantized, and a rounded
    router can choose other experts). Returns counts by type."""
    # q/k rows are reordered before quantizing: quantization works on whole rows, so this is
    # the file llama.cpp's converter writes.
    tensors = [
        (to_gguf_name(n), n, source.theta[n], lambda n=n: interleave_rotary(n, source.read(n), config, to_gguf=True))
        for n in source.names()
    ]
    routers = {g for g, *_ in tensors if g.endswith(".ffn_gate_inp.weight")}
    entries, counts = quantized_entries(tensors, to, path=path, progress=progress, keep=routers)
    write_entries(path, config, entries)
    return counts


def write_entries(path: str | os.PathLike, config: LlamaConfig, entries: list) -> None:
    """Write GGUF ``entries`` (llama.cpp names, see ``sharktank.weights.gguf_write``) with
    ``config``'s metadata, and its ``rope_freqs`` tensor last if it has one."""
    factors = rope_freqs_array(config)
    if factors is not None:
        entries = [*entries, (ROPE_FREQS, (factors.shape, factors.dtype, factors.nbytes, "F32"), lambda: factors)]
    write_gguf(path, config.architecture, gguf_metadata(config), entries)
