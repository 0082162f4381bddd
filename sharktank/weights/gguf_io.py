"""GGUF files of the ``llama`` architecture (f32, f16 and bf16 tensors).

Tensor names and metadata keys follow llama.cpp. As there, attn_q/attn_k weights (and
biases) are stored with each head's rows interleaved for llama.cpp's pairwise rotary
embedding: :func:`save_gguf` interleaves from the Hugging Face layout and
:func:`load_gguf` undoes it, so a round trip returns the Hugging Face tensors exactly.
GGUF lists dims fastest-first (ggml ``ne``); the ``gguf`` library reverses them to numpy
order on both sides, which is the torch order used here.

llama3 rope scaling has no llama.cpp metadata keys: llama.cpp's converter bakes it into a
``rope_freqs`` tensor of per-frequency divisors, which loads as a config with
``rope_scaling={"rope_type": "factors", "factors": [...]}`` (the same frequencies). This
writer keeps llama3's own parameters under ``sharktank.rope_scaling.*`` instead, and writes
``rope_freqs`` for a "factors" config. The files carry no tokenizer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.llama.config import LlamaConfig
from ..types import LAYOUTS, QuantizedTensor, ShardedTensor
from ._files import atomic_file
from .errors import WeightsError
from .llama_layout import layout_problem, llama_shapes
from .source import WeightSource
from .theta import Theta

__all__ = ["load_gguf", "gguf_source", "save_gguf", "write_gguf", "quantize_gguf", "QUANTIZE_TO"]

ARCH = "llama"
ROPE_FREQS = "rope_freqs.weight"
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_ROTARY = re.compile(r"\.(q|k)_proj\.(weight|bias)$")  # the tensors _interleave_rotary reorders
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_SCALING_PREFIX = "sharktank.rope_scaling."
# torch dtype <-> ggml type; numpy has no bfloat16, so bf16 travels as its uint16 bits.
_GGML_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def save_gguf(path: str | os.PathLike, config: LlamaConfig, theta: Theta) -> None:
    """Write a Hugging Face-layout Llama ``theta`` as a llama.cpp GGUF file.

    ``theta`` must hold exactly the model's parameters (plain f32/f16/bf16 tensors or
    :class:`QuantizedTensor` blocks) with the shapes ``config`` implies. The file is written
    next to ``path`` and renamed into place.
    """
    problem = layout_problem({n: t.shape for n, t in theta.items()}, config)
    if problem is not None:
        raise WeightsError(f"cannot save: {problem[1]}", path=path, tensor=problem[0])
    entries = []
    for name in llama_shapes(config):
        t = theta[name]
        if isinstance(t, ShardedTensor) or not (isinstance(t, QuantizedTensor) or t.dtype in _GGML_TYPES):
            what = type(t).__name__ if isinstance(t, ShardedTensor) else t.dtype
            raise WeightsError(f"cannot save {what}; GGUF takes plain f32, f16 or bf16 tensors or QuantizedTensor ({', '.join(LAYOUTS)})", path=path, tensor=name)
        entries.append((name, _stored_spec(t), lambda name=name, t=t: _gguf_array(name, t, config)))
    write_gguf(path, config, entries)


def _stored_spec(t) -> tuple:
    """(array shape, numpy dtype, bytes, ggml type name) of the array GGUF stores for ``t``."""
    if isinstance(t, QuantizedTensor):
        rows = t.shape[0] if t.ndim > 1 else 1
        return (rows, t.nbytes // rows), np.uint8, t.nbytes, t.layout.name
    np_dtype = np.uint16 if t.dtype == torch.bfloat16 else {torch.float32: np.float32, torch.float16: np.float16}[t.dtype]
    return tuple(t.shape), np_dtype, t.numel() * t.element_size(), _GGML_TYPES[t.dtype]


def _gguf_array(name: str, t, config: LlamaConfig) -> np.ndarray:
    """The array GGUF stores for the Hugging Face tensor ``name`` (q/k rows reordered)."""
    t = _interleave_rotary(name, t, config, to_gguf=True)
    if isinstance(t, QuantizedTensor):
        return t.blocks.reshape(_stored_spec(t)[0]).contiguous().numpy()
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


# Types ``quantize_gguf`` makes with the gguf package's own quantizers (it has none for K-quants).
QUANTIZE_TO = {"q8_0": "Q8_0", "q4_0": "Q4_0"}


def quantize_gguf(path: str | os.PathLike, config: LlamaConfig, source, *, to: str, progress=lambda msg: None) -> dict[str, int]:
    """Write ``source`` (a :class:`WeightSource` in the Hugging Face layout) as a GGUF whose 2-D
    weights are quantized to ``to`` (``q8_0`` or ``q4_0``) by ``gguf.quants.quantize``, one
    tensor in memory at a time. Norms and biases stay float32; a weight whose rows are not
    whole blocks, or that is quantized already, is written as it is. Returns counts by type."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if to not in QUANTIZE_TO:
        raise ValueError(f"cannot quantize to {to!r}; supported: {', '.join(QUANTIZE_TO)}")
    kind = QUANTIZE_TO[to]
    layout = LAYOUTS[kind]
    entries, counts = [], {}
    names = list(source.names())
    for i, name in enumerate(names):
        t = source.theta[name]
        quantizable = not isinstance(t, QuantizedTensor) and t.ndim == 2 and t.shape[1] % layout.block_size == 0
        if quantizable:
            nbytes = t.shape[0] * t.shape[1] // layout.block_size * layout.block_bytes
            spec = ((t.shape[0], nbytes // t.shape[0]), np.uint8, nbytes, kind)

            def produce(name=name, i=i):
                rows = _interleave_rotary(name, source.read(name).float(), config, to_gguf=True)
                progress(f"quantized {i + 1}/{len(names)}: {name}")
                return quantize(rows.contiguous().numpy(), GGMLQuantizationType[kind])
        else:
            # Norms and biases become float32; other weights keep their type. The spec comes
            # from the shape alone: the placeholder is never converted (that would touch it).
            to_f32 = not isinstance(t, QuantizedTensor) and t.ndim != 2
            if not (to_f32 or isinstance(t, QuantizedTensor) or t.dtype in _GGML_TYPES):
                raise WeightsError(f"cannot store {t.dtype} in GGUF", path=path, tensor=name)
            spec = (tuple(t.shape), np.float32, t.numel() * 4, "F32") if to_f32 else _stored_spec(t)

            def produce(name=name, to_f32=to_f32):
                value = source.read(name)
                return _gguf_array(name, value.float() if to_f32 else value, config)
        counts[spec[3]] = counts.get(spec[3], 0) + 1
        entries.append((name, spec, produce))
    write_gguf(path, config, entries)
    return counts


def write_gguf(path: str | os.PathLike, config: LlamaConfig, entries) -> None:
    """Write a llama GGUF tensor by tensor: ``entries`` are ``(Hugging Face name, spec, produce)``
    with ``spec`` as :func:`_stored_spec` gives it and ``produce()`` returning that array,
    called once, in order, after the header is written (one tensor in memory at a time)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    with atomic_file(path) as tmp:
        writer = GGUFWriter(str(tmp), ARCH)
        for key, (kind, value) in _metadata(config).items():
            getattr(writer, f"add_{kind}")(key, value)
        factors = None
        if config.rope_scaling is not None and config.rope_scaling["rope_type"] == "factors":
            # As llama.cpp's converter stores llama3 scaling: one divisor per rotary frequency.
            factors = np.asarray(config.rope_scaling["factors"], dtype=np.float32)
        for name, (shape, np_dtype, nbytes, kind), _ in entries:
            writer.add_tensor_info(_to_gguf_name(name), shape, np.dtype(np_dtype), nbytes, raw_dtype=GGMLQuantizationType[kind])
        if factors is not None:
            writer.add_tensor_info(ROPE_FREQS, factors.shape, factors.dtype, factors.nbytes, raw_dtype=GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, (shape, np_dtype, nbytes, _), produce in entries:
            array = produce()
            if array.nbytes != nbytes or array.dtype != np.dtype(np_dtype):
                raise WeightsError(f"produced {array.dtype} of {array.nbytes} bytes, declared {np.dtype(np_dtype)} of {nbytes}", path=path, tensor=name)
            writer.write_tensor_data(array)
        if factors is not None:
            writer.write_tensor_data(factors)
        writer.close()


def load_gguf(path: str | os.PathLike) -> tuple[LlamaConfig, Theta]:
    """Read a llama GGUF file into (config, theta) in the Hugging Face layout.

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
    from gguf import GGUFReader

    if not Path(path).is_file():
        raise WeightsError("GGUF file not found", path=path)
    try:
        reader = GGUFReader(path)
        # contents() decodes strings lazily: a damaged one raises UnicodeDecodeError here.
        fields = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError... by case
        raise WeightsError(f"not a readable GGUF file: {type(e).__name__}: {e}", path=path) from None
    if fields.get("general.architecture") != ARCH:
        raise WeightsError(f"general.architecture is {fields.get('general.architecture')!r}, expected {ARCH!r}", path=path)
    infos: dict[str, _TensorInfo] = {}
    rope_freqs = None
    for rt in reader.tensors:
        if rt.name == ROPE_FREQS:  # llama.cpp's llama3 scaling, precomputed per frequency
            rope_freqs = _tensor_info(path, rt)
            continue
        hf_name = _to_hf_name(rt.name)
        if hf_name is None:
            raise WeightsError("not a tensor of the llama architecture this loader knows", path=path, tensor=rt.name)
        infos[hf_name] = _tensor_info(path, rt)
    del reader  # its memory map: reads below are positioned reads of the file
    config = _config(path, fields, infos, rope_freqs)
    problem = layout_problem({n: i.shape for n, i in infos.items()}, config)
    if problem is not None:
        name, reason = problem
        raise WeightsError(f"{reason} (Hugging Face name {name})", path=path, tensor=_to_gguf_name(name))

    def read(name: str):
        t = _interleave_rotary(name, infos[name].read(path), config, to_gguf=False)
        return t if isinstance(t, QuantizedTensor) else t.contiguous()

    specs = {n: infos[n].spec for n in llama_shapes(config)}
    # Every tensor but q and k (reordered from llama.cpp's rotary layout) is stored as read.
    spans = {n: (str(path), infos[n].offset) for n in specs if not _ROTARY.search(n)}
    return config, WeightSource(specs, read, spans=spans, label=str(path))


def _metadata(config: LlamaConfig) -> dict[str, tuple[str, Any]]:
    """GGUF key -> (writer value kind, value)."""
    m: dict[str, tuple[str, Any]] = {
        f"{ARCH}.vocab_size": ("uint32", config.vocab_size),
        f"{ARCH}.context_length": ("uint32", config.max_seq_len),
        f"{ARCH}.embedding_length": ("uint32", config.hidden_size),
        f"{ARCH}.block_count": ("uint32", config.num_layers),
        f"{ARCH}.feed_forward_length": ("uint32", config.intermediate_size),
        f"{ARCH}.attention.head_count": ("uint32", config.num_heads),
        f"{ARCH}.attention.head_count_kv": ("uint32", config.num_kv_heads),
        f"{ARCH}.attention.key_length": ("uint32", config.head_dim),
        f"{ARCH}.attention.value_length": ("uint32", config.head_dim),
        f"{ARCH}.attention.layer_norm_rms_epsilon": ("float32", config.rms_norm_eps),
        f"{ARCH}.rope.freq_base": ("float32", config.rope_theta),
        f"{ARCH}.rope.dimension_count": ("uint32", config.head_dim),
    }
    if config.rope_scaling is not None and config.rope_scaling["rope_type"] != "factors":  # factors: a rope_freqs tensor
        m[_SCALING_PREFIX + "type"] = ("string", config.rope_scaling["rope_type"])
        for k in _SCALING_KEYS:
            m[_SCALING_PREFIX + k] = ("float64", float(config.rope_scaling[k]))
    return m


def _rope_factors(path, info: "_TensorInfo", fields: dict[str, Any]) -> list[float]:
    """The per-frequency divisors of a ``rope_freqs`` tensor, checked against the head size."""
    key_length = fields.get(f"{ARCH}.attention.key_length") or fields.get(f"{ARCH}.rope.dimension_count")
    if key_length is None:
        key_length = int(fields[f"{ARCH}.embedding_length"]) // int(fields[f"{ARCH}.attention.head_count"])
    want = int(key_length) // 2
    if info.dtype != torch.float32 or info.shape != (want,):
        raise WeightsError(f"is {info.dtype} {list(info.shape)}; expected float32 [{want}] (one factor per rotary frequency)", path=path, tensor=ROPE_FREQS)
    factors = info.read(path)
    if not bool((factors > 0).all()) or not bool(factors.isfinite().all()):
        raise WeightsError("holds a factor that is not a positive finite number", path=path, tensor=ROPE_FREQS)
    return [float(f) for f in factors]


def _config(path, fields: dict[str, Any], tensors: dict[str, "_TensorInfo"], rope_freqs: "_TensorInfo | None") -> LlamaConfig:
    def need(key: str) -> Any:
        if key not in fields:
            raise WeightsError(f"metadata key {key!r} is missing", path=path)
        return fields[key]

    if "model.embed_tokens.weight" not in tensors:
        raise WeightsError("missing", path=path, tensor="token_embd.weight")
    hidden, heads = int(need(f"{ARCH}.embedding_length")), int(need(f"{ARCH}.attention.head_count"))
    scaling = None
    if _SCALING_PREFIX + "type" in fields:
        scaling = {"rope_type": fields[_SCALING_PREFIX + "type"]}
        scaling.update({k: need(_SCALING_PREFIX + k) for k in _SCALING_KEYS})
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    elif rope_freqs is not None:
        # llama.cpp's converter writes Llama 3.1+'s llama3 scaling as these factors alone.
        scaling = {"rope_type": "factors", "factors": _rope_factors(path, rope_freqs, fields)}
    elif any(k.startswith(f"{ARCH}.rope.scaling.") for k in fields):
        kind = fields.get(f"{ARCH}.rope.scaling.type", "?")
        raise WeightsError(f"rope scaling {kind!r} is not supported (supported: llama3, as sharktank.rope_scaling.* keys or a {ROPE_FREQS} tensor)", path=path)
    try:
        return LlamaConfig(
            vocab_size=tensors["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(need(f"{ARCH}.feed_forward_length")),
            num_layers=int(need(f"{ARCH}.block_count")),
            num_heads=heads,
            num_kv_heads=int(fields.get(f"{ARCH}.attention.head_count_kv", heads)),
            head_dim=int(fields.get(f"{ARCH}.attention.key_length", hidden // heads)),
            rms_norm_eps=_f32_decimal(need(f"{ARCH}.attention.layer_norm_rms_epsilon")),
            rope_theta=_f32_decimal(fields.get(f"{ARCH}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=int(need(f"{ARCH}.context_length")),
            attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
            o_bias="model.layers.0.self_attn.o_proj.bias" in tensors,
            mlp_bias="model.layers.0.mlp.gate_proj.bias" in tensors,
            tie_word_embeddings="lm_head.weight" not in tensors,
        )
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise WeightsError(f"metadata does not describe a Llama model: {e}", path=path) from None


def _f32_decimal(value: float) -> float:
    # The GGUF keys are float32: 1e-6 comes back as 9.99999997e-07. Take the shortest
    # decimal that rounds to the same float32, i.e. the number that was written.
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class _TensorInfo:
    gguf_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # a quantized tensor's: float32, what it dequantizes to
    offset: int  # of the data in the file
    nbytes: int
    layout: str | None = None  # the GGML block layout of a quantized tensor

    @property
    def spec(self) -> tuple:
        return (self.shape, self.dtype) if self.layout is None else (self.shape, self.dtype, self.layout)

    def read(self, path) -> torch.Tensor | QuantizedTensor:
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), self.nbytes, self.offset)
        if len(data) != self.nbytes:
            raise WeightsError(f"file ends {self.nbytes - len(data)} bytes into this tensor", path=path, tensor=self.gguf_name)
        if self.layout is not None:  # kept as the blocks the file stores
            blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return QuantizedTensor(self.layout, self.shape, blocks, dtype=self.dtype, name=self.gguf_name)
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(self.shape)


_SUPPORTED = ", ".join([*_GGML_TYPES.values(), *LAYOUTS])


def _tensor_info(path, rt) -> _TensorInfo:
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
        return _TensorInfo(rt.name, shape, torch.float32, int(rt.data_offset), want, kind)
    dtype = {v: k for k, v in _GGML_TYPES.items()}.get(kind)
    if dtype is None:
        raise WeightsError(f"ggml type {kind} is not supported (supported: {_SUPPORTED})", path=path, tensor=rt.name)
    if int(rt.n_bytes) != count * dtype.itemsize:
        raise WeightsError(f"holds {int(rt.n_bytes) // dtype.itemsize} values for shape {list(shape)}", path=path, tensor=rt.name)
    return _TensorInfo(rt.name, shape, dtype, int(rt.data_offset), int(rt.n_bytes))


def _interleave_rotary(name: str, t: torch.Tensor, config: LlamaConfig, *, to_gguf: bool) -> torch.Tensor:
    """Reorder the rows of each q/k head between the HF layout and llama.cpp's.

    HF keeps a head's rotary pairs as (row j, row j + head_dim/2); llama.cpp keeps them
    adjacent (rows 2j, 2j+1).
    """
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads = config.num_heads
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = config.num_kv_heads
    else:
        return t
    half = config.head_dim // 2
    split = (heads, 2, half) if to_gguf else (heads, half, 2)
    if isinstance(t, QuantizedTensor):  # rows are whole blocks: reorder the block rows
        b = t.blocks
        return t.with_blocks(b.reshape(*split, *b.shape[1:]).transpose(1, 2).reshape(b.shape))
    return t.reshape(*split, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _to_gguf_name(hf: str) -> str:
    if hf in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"no GGUF name for {hf!r}")
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _to_hf_name(gguf: str) -> str | None:
    for hf, g in _GLOBAL_NAMES.items():
        if g == gguf:
            return hf
    m = _GGUF_LAYER.fullmatch(gguf)
    if m is None:
        return None
    for hf_mid, g_mid in _LAYER_NAMES.items():
        if g_mid == m.group(2):
            return f"model.layers.{m.group(1)}.{hf_mid}.{m.group(3)}"
    return None
