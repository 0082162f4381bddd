"""Write a random-weight Hugging Face Llama checkpoint with a published config's shapes.

    python tools/make_checkpoint.py --config llama-3.2-1b|llama-3.1-8b|tiny|CONFIG.json
        --dtype bfloat16|float16|float32 [--seed N] [--shard-size BYTES] [--force] OUT

OUT gets ``config.json`` (the published Llama config dict, loadable by transformers and by
``sharktank.models.load_hf_checkpoint``) and safetensors: ``model.safetensors`` when the
tensors fit in one shard, else ``model-0000K-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), as
``save_pretrained`` writes them. It also gets a byte-level ``tokenizer.json`` (the 256 byte
tokens, no merges, the config's BOS/EOS ids as special tokens) and ``tokenizer_config.json``, so
text and serving run on it: not the published tokenizer, which cannot be made here.

It streams: tensors are generated one at a time in model order and a shard is written (by
``safetensors.torch.save_file``) as soon as the next tensor would not fit, so the writer holds
at most one shard, or one tensor larger than a shard. Each tensor is drawn from a generator
seeded by (seed, name), so its values do not depend on the shard size. Everything is written
in a temporary directory beside OUT, renamed into place once complete.

``cached_checkpoint(config, dtype, seed)`` writes one once under the cache directory
(``$SHARKTANK_CACHE``, default ``~/.cache/sharktank``, then ``checkpoints/<config>-<dtype>-s<seed>``)
and returns its path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from sharktank.models.llama.config import LlamaConfig
from sharktank.weights._files import atomic_dir
from sharktank.weights.hf import INDEX_FILE, SINGLE_FILE
from sharktank.models.llama.layout import llama_shapes

__all__ = ["CONFIGS", "DTYPES", "hf_config", "plan_shards", "random_tensor", "write_checkpoint", "cached_checkpoint", "main"]

DEFAULT_SHARD_SIZE = 1 << 30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The fields of the published config.json files, in their spelling (rope_scaling and rope_theta,
# which transformers 5 reads into rope_parameters).
_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "use_cache": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}


def _llama3_scaling(factor: float, original: int = 8192) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": original}


CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**_COMMON, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "rope_scaling": _llama3_scaling(32.0), "tie_word_embeddings": True},
    "llama-3.1-8b": {**_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "rope_scaling": _llama3_scaling(8.0), "tie_word_embeddings": False},
    # CI-sized, with the 1B's features (GQA, llama3 rope scaling, tied embeddings).
    "tiny": {**_COMMON, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "rope_scaling": _llama3_scaling(32.0, 512), "tie_word_embeddings": True,
             "max_position_embeddings": 16384, "bos_token_id": 1, "eos_token_id": 2},
}


def hf_config(config: str | os.PathLike, dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json dict for a name in CONFIGS or a path to a JSON LlamaConfig dict."""
    if str(config) in CONFIGS:
        d = dict(CONFIGS[str(config)])
    else:
        path = Path(config)
        if not path.is_file():
            raise ValueError(f"--config {config!r}: neither one of {sorted(CONFIGS)} nor a JSON file")
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or d.get("model_type", "llama") != "llama":
            raise ValueError(f"{path}: not a Llama config dict (model_type {d.get('model_type') if isinstance(d, dict) else None!r})")
        d.setdefault("model_type", "llama")
        d.setdefault("architectures", ["LlamaForCausalLM"])
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    d["torch_dtype"] = dtype
    return d


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Tensor ``name``: normal with std 0.02 (HF's initializer range), mean 1 for norm weights.

    Drawn directly in ``dtype`` (no float32 copy) from a generator seeded by (seed, name).
    """
    g = torch.Generator().manual_seed(_seed_of(seed, name))
    mean = 1.0 if name.endswith("norm.weight") else 0.0
    return torch.empty(shape, dtype=dtype).normal_(mean, 0.02, generator=g)


def _header_bound(name: str, shape: tuple[int, ...]) -> int:
    """An upper bound on a tensor's entry in a safetensors JSON header (plus alignment)."""
    return 96 + len(name) + 21 * (len(shape) + 2)


def plan_shards(sizes: dict[str, int], shard_size: int) -> list[list[str]]:
    """Names per shard, in order: a shard closes when the next tensor would pass ``shard_size``.

    ``sizes`` are the bytes each tensor takes in a file (data plus its header entry); a tensor
    larger than ``shard_size`` gets a shard of its own.
    """
    shards: list[list[str]] = [[]]
    used = 1024  # the 8-byte length, the metadata entry and the braces
    for name, size in sizes.items():
        if shards[-1] and used + size > shard_size:
            shards.append([])
            used = 1024
        shards[-1].append(name)
        used += size
    return shards


def _shard_file(k: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def write_checkpoint(
    out: str | os.PathLike,
    config: str | os.PathLike = "tiny",
    dtype: str = "bfloat16",
    *,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    force: bool = False,
    log: TextIO | None = sys.stderr,
) -> dict[str, Any]:
    """Write the checkpoint to ``out`` and return a summary (files, tensors, bytes, seconds).

    An existing non-empty ``out`` is refused (FileExistsError) unless ``force``. On any error
    nothing is left: not ``out`` (if it did not exist) nor the temporary directory.
    """
    from safetensors.torch import save_file

    may_replace = (lambda p: True) if force else (lambda p: not any(p.iterdir()))
    if Path(out).exists() and not (Path(out).is_dir() and may_replace(Path(out))):
        raise FileExistsError(f"{out}: exists and is not an empty directory (--force replaces it)")
    d = hf_config(config, dtype)
    torch_dtype = DTYPES[dtype]
    shapes = llama_shapes(LlamaConfig.from_hf(d))
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    nbytes = {name: math.prod(shape) * itemsize for name, shape in shapes.items()}
    shards = plan_shards({n: nbytes[n] + _header_bound(n, s) for n, s in shapes.items()}, shard_size)
    total = sum(nbytes.values())
    start = time.perf_counter()
    done = 0
    umask = os.umask(0)
    os.umask(umask)

    def say(text: str) -> None:
        if log is not None:
            print(f"[make_checkpoint] {text}", file=log, flush=True)

    say(f"{config} {dtype} seed {seed}: {len(shapes)} tensors, {_size(total)} in {len(shards)} file(s) -> {out}")
    with atomic_dir(out, may_replace=may_replace, marker="config.json") as tmp:
        weight_map: dict[str, str] = {}
        for k, names in enumerate(shards):
            file = _shard_file(k, len(shards))
            tensors = {name: random_tensor(name, shapes[name], torch_dtype, seed) for name in names}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            os.chmod(tmp / file, 0o644 & ~umask)  # safetensors creates it 0600
            del tensors
            weight_map.update((name, file) for name in names)
            done += sum(nbytes[n] for n in names)
            say(f"{file}: {len(weight_map)}/{len(shapes)} tensors, {_size(done)}/{_size(total)}, {time.perf_counter() - start:.1f} s")
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        write_tokenizer(tmp, d)
        (tmp / "config.json").write_text(json.dumps(d, indent=2) + "\n")  # last: the marker atomic_dir removes first
    seconds = time.perf_counter() - start
    say(f"done: {total} bytes ({_size(total)}) in {len(shards)} file(s), {seconds:.1f} s ({total / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
    return {"path": Path(out), "files": len(shards), "tensors": len(shapes), "bytes": total, "seconds": seconds}


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_tokenizer(directory: Path, d: dict[str, Any]) -> None:
    """A byte-level BPE ``tokenizer.json`` for config ``d`` (a Hugging Face config dict):
    BOS and EOS at the config's ``bos_token_id``/``eos_token_id``, the 256 byte tokens at the
    lowest other ids, and unreachable placeholders in any gap below the specials; plus
    ``tokenizer_config.json`` naming BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = {d.get("bos_token_id", 256): BOS, d.get("eos_token_id", 257): EOS}
    if len(specials) != 2 or max(specials) >= d["vocab_size"] or d["vocab_size"] < 258:
        raise ValueError(f"a byte-level tokenizer needs 258 ids and distinct BOS/EOS ids below vocab_size {d['vocab_size']}, found {specials}")
    alphabet = iter(sorted(pre_tokenizers.ByteLevel.alphabet()))
    vocab, i = {}, 0
    while len(vocab) < 256 + 2 or i <= max(specials):
        vocab[specials[i] if i in specials else next(alphabet, f"<|reserved_{i}|>")] = i
        i += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, vocab[BOS])])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def cache_root() -> Path:
    """``$SHARKTANK_CACHE``, or ``~/.cache/sharktank``."""
    return Path(os.environ.get("SHARKTANK_CACHE") or Path.home() / ".cache" / "sharktank")


def cached_checkpoint(config: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A checkpoint for (config, dtype, seed) under ``cache_root()/checkpoints``, written once.

    ``config`` is a name in CONFIGS or a JSON file (keyed by its name and a hash of its bytes).
    """
    if config in CONFIGS:
        key = config
    else:
        path = Path(config)
        key = f"{path.stem}-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"
    target = cache_root() / "checkpoints" / f"{key}-{dtype}-s{seed}"
    if (target / "config.json").is_file():
        if not (target / "tokenizer.json").is_file():  # cached before checkpoints had one
            with tempfile.TemporaryDirectory(dir=target) as tmp:
                write_tokenizer(Path(tmp), json.loads((target / "config.json").read_text()))
                for f in ("tokenizer_config.json", "tokenizer.json"):  # each file whole; tokenizer.json last
                    os.replace(Path(tmp) / f, target / f)
        return target
    try:
        write_checkpoint(target, config, dtype, seed=seed)
    except FileExistsError:
        if not (target / "config.json").is_file():  # not another process finishing first
            raise
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Weights are random (seeded), with the published shapes and config; nothing is downloaded. "
        "Progress and a final summary (bytes, seconds) go to stderr.",
    )
    parser.add_argument("out", type=Path, help="the checkpoint directory to create")
    parser.add_argument("--config", default="tiny", help=f"one of {', '.join(CONFIGS)}, or a JSON file with a transformers LlamaConfig dict (default tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="tensor dtype (default bfloat16)")
    parser.add_argument("--seed", type=int, default=0, help="each tensor is drawn from a generator seeded by (seed, name) (default 0)")
    parser.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
                        help=f"bytes per safetensors file at most, unless one tensor is larger (default {DEFAULT_SHARD_SIZE}, 1 GiB); "
                        "the writer holds one shard in memory")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT")
    args = parser.parse_args(argv)
    try:
        write_checkpoint(args.out, args.config, args.dtype, seed=args.seed, shard_size=args.shard_size, force=args.force)
    except (FileExistsError, ValueError) as e:
        print(f"make_checkpoint: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
