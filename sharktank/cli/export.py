"""`sharktank export`: a model sharded and exported (and compiled) into an artifact directory."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from .common import CliError, ints, say

__all__ = ["add_parser", "cmd_export"]

NAME = "export"
HELP = "export (and compile) a sharded model to a directory"  # the line in `sharktank --help`

_RECIPE_KEYS = {
    "model", "tp", "ep", "pp", "hosts", "placement", "batch_sizes", "functions", "max_seq_len", "page_size", "dtype", "exact_prompts", "target", "target_arch", "compile_flags", "seed",
}
_DEFAULTS = {
    "tp": 1, "ep": 1, "pp": None, "hosts": None, "placement": None, "batch_sizes": "1", "functions": None, "max_seq_len": None, "page_size": None, "dtype": None,
    "exact_prompts": False, "target": "cpu", "target_arch": None, "compile_flags": [], "seed": 0,
}


def _load_recipe(path: str) -> dict:
    p = Path(path)
    try:
        recipe = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise CliError(f"recipe {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise CliError(f"recipe {p} is not valid TOML: {e}") from None
    unknown = set(recipe) - _RECIPE_KEYS
    if unknown:
        raise CliError(f"recipe {p}: unknown keys {sorted(unknown)}; known: {sorted(_RECIPE_KEYS)}")
    if isinstance(recipe.get("placement"), str) and not Path(recipe["placement"]).is_absolute():
        recipe["placement"] = str(p.parent / recipe["placement"])  # relative to the recipe file
    for key in ("batch_sizes", "functions"):
        if isinstance(recipe.get(key), list):
            recipe[key] = ",".join(str(b) for b in recipe[key])
    return recipe


def _export_settings(args) -> dict:
    settings = dict(_DEFAULTS)
    if args.recipe:
        settings.update(_load_recipe(args.recipe))
    for key in _RECIPE_KEYS:
        value = getattr(args, key, None)
        if value is not None and value != []:
            settings[key] = value
    if not settings.get("model"):
        raise CliError("give --model (or a --recipe that names one)")
    return settings


def cmd_export(args) -> int:
    import torch

    from ..export.artifact import export_artifact
    from ..export.manifest import HostsManifest
    from ..models import load_model

    s = _export_settings(args)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if s["dtype"] is not None and s["dtype"] not in dtypes:
        raise CliError(f"--dtype must be one of {sorted(dtypes)}, found {s['dtype']!r}")
    functions = None
    if s["functions"] is not None:  # names checked before the model loads; the plan's limits by export_artifact
        from ..export.artifact import exported_kinds

        functions = tuple(k.strip() for k in str(s["functions"]).split(",") if k.strip())
        try:
            exported_kinds(functions, hosts=1, paths=1)
        except ValueError as e:
            raise CliError(f"--functions: {e}") from None
    ep = f", ep={s['ep']}" if int(s["ep"]) > 1 else ""
    say(args, f"loading {s['model']} (tp={s['tp']}{ep}, pp={s['pp'] or 1}{', placement ' + str(s['placement']) if s['placement'] else ''})")
    model = load_model(
        s["model"], tp=int(s["tp"]), ep=int(s["ep"]), pp=s["pp"] and int(s["pp"]), placement=s["placement"],
        dtype=dtypes.get(s["dtype"]) if s["dtype"] else None, seed=int(s["seed"]), deferred=True,
    )
    say(args, model.plan.describe())
    options = dict(
        source=str(s["model"]),
        batch_sizes=tuple(ints(s["batch_sizes"], "--batch-sizes")),
        max_seq_len=s["max_seq_len"] and int(s["max_seq_len"]),
        target=s["target"],
        target_arch=s["target_arch"],
        extra_flags=tuple(s["compile_flags"]),
        compile=not args.no_compile,
        progress=lambda m: say(args, m),
        functions=functions,
        exact_prompts=bool(s["exact_prompts"]),
    )
    if s["page_size"] is not None:
        if isinstance(s["page_size"], bool) or int(s["page_size"]) < 1:
            raise CliError(f"--page-size must be a number of positions >= 1, found {s['page_size']!r}")
        options["page_size"] = int(s["page_size"])
    out = Path(args.output_dir)
    manifest = export_artifact(model, out, hosts=s["hosts"] and int(s["hosts"]), **options)
    if isinstance(manifest, HostsManifest):
        return _hosts_summary(args, manifest, out)
    summary = {
        "output_dir": str(out),
        "export_seconds": manifest.export_seconds,
        "compile_seconds": manifest.compile["seconds"] if manifest.compile else None,
        "module_bytes": manifest.module.get("vmfb_size"),
        "parameter_bytes": sum(f["size"] for f in manifest.parameters["files"].values()),
        "transfers": manifest.transfers,
        "device_count": manifest.device_count,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {out}: {summary['device_count']} devices, transfers per function {summary['transfers']}")
    return 0


def _hosts_summary(args, manifest, out: Path) -> int:
    summary = {
        "output_dir": str(out),
        "hosts": [{k: h.data[k] for k in ("host", "dir", "stages", "blocks", "devices", "device_count", "transfers")} for h in manifest.hosts],
        "export_seconds": manifest.export_seconds,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for h in summary["hosts"]:
            print(f"wrote {out / h['dir']}: host {h['host']}, stages {h['stages']}, {h['device_count']} devices, transfers per function {h['transfers']}")
    return 0


def add_parser(sub) -> None:
    """Declare `sharktank export` on the subcommand set ``sub``."""
    from ..export.cache_size import DEFAULT_MAX_SEQ_LEN
    from ..export.compile import TARGETS
    from ..models import SOURCES_HELP

    e = sub.add_parser(
        NAME, help=HELP,
        description="Export a model sharded tp-way over pp pipeline stages (or as a placement file says) "
        "to DIR: model.mlir, model.vmfb, one device_N.irpa of weight shards per device, manifest.json. "
        "The previous DIR is kept intact if anything fails.",
    )
    e.add_argument("--model", help=f"what to export: {SOURCES_HELP}")
    e.add_argument("--recipe", help="a TOML recipe (e.g. exports/toy-llama-tp2-pp2.toml); flags override its keys")
    e.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    e.add_argument("--ep", type=int, help="a mixture of experts: 1 (default; each expert split tp-way as the dense FFN), the "
                   "tp size (expert parallelism: whole experts per device over each tensor-parallel group), or any N with --tp 1 "
                   "(expert parallelism alone: each stage on N devices holding whole experts, every other weight and the KV cache "
                   "replicated on each, one all-reduce per block); the expert count must divide by it")
    e.add_argument("--pp", type=int, help="pipeline stages (default 1, or the placement's)")
    e.add_argument("--hosts", type=int, help="split the pipeline stages over this many hosts (must divide pp): one program per host in "
        "DIR/host_N/, run with torchrun (default: one program, or the hosts the placement names, which --hosts must then match)")
    e.add_argument("--placement", help="placement directives (JSON: place/path directives); a \"host\" in every place directive "
        "exports one program per host, each host holding consecutive stages (as many as it names, e.g. exports/placements/tp2-pp4-hosts-3-1.json)")
    e.add_argument("--batch-sizes", dest="batch_sizes", help="comma-separated batch sizes to export (default 1)")
    e.add_argument(
        "--functions", metavar="KINDS",
        help="comma-separated function kinds to export for each batch size, among prefill, decode, prefill_row, "
        "prefill_rows and prefill_chunk; prefill and decode are required (default: all the plan has; over several hosts "
        "prefill, decode and prefill_row). Each kind adds compile time: `run` needs only prefill,decode (with prefill_chunk "
        "a prompt longer than 512 tokens is prefilled in chunks of 512, faster at long prompts); `serve` batches "
        "over prefill_row and prefill_rows (batches of several rows) or prefill_chunk (chunked prefill). --page-size adds the paged ones",
    )
    e.add_argument("--max-seq-len", dest="max_seq_len", type=int, help=f"KV-cache length (default: the model's context, at most {DEFAULT_MAX_SEQ_LEN}; refused when it and the "
        "weights would not fit in this host's memory for a CPU target)")
    e.add_argument(
        "--dtype",
        help="convert the weights (and so the activations) to float32, float16 or bfloat16 (default: as stored; quantized "
        "GGUF blocks stay blocks). A CPU has no float16 arithmetic: for the cpu target (compiled for this host) float16 "
        "weights' products are hand-written kernels that read the weight as stored (a decode step's in float32, a prompt's "
        "rounded to bfloat16 like quantized weights': see --exact-prompts), so an F16 GGUF runs as stored at about "
        "llama.cpp's speed; --dtype bfloat16 rounds the weights themselves (8 significant bits to float16's 11, its "
        "logits stray further from float32's: tools/half_precision_table.py measures both). On a CPU without AVX512-BF16 "
        "(AVX2 only) bfloat16 weights take the same kernels, since such a CPU has no bfloat16 arithmetic either",
    )
    e.add_argument(
        "--page-size", dest="page_size", type=int, metavar="POSITIONS",
        help="also export the paged functions (prefill_paged, decode_paged) over a pool of KV-cache pages of this many positions "
        "(e.g. 16), which `serve` then uses: memory for the tokens in use instead of --max-seq-len per row, and prefix caching "
        "across requests. For the cpu target a paged decode step's attention reads the pool through the page table, "
        "only the entries the mask keeps (SmolLM2 batch 8 at 1000 of 2048 positions: 1.08x the contiguous step); other "
        "targets and the paged prefill gather each row's pages before attending. One host and one microbatch path only "
        "(default: off). With --functions prefill,decode the artifact serves from the pool alone",
    )
    e.add_argument(
        "--exact-prompts", dest="exact_prompts", action="store_true", default=None,
        help="cpu target, a float32 or float16 model with quantized (GGUF) or float16 weights: compute a prompt's products "
        "(more than 8 rows) as eager does, the weight dequantized to x's dtype for a dense product, instead of the prefill "
        "dispatches, which convert tiles of the weight to bfloat16 and round x to bfloat16 (about 2e-3 of each product, as "
        "llama.cpp rounds its activations to 8-bit blocks; SmolLM2's perplexity 8.446 against 8.462) and run several times "
        "faster (a float16 product: 3x). Decode steps and bfloat16 models are the same either way (default: the prefill dispatches)",
    )
    e.add_argument("--target", choices=list(TARGETS), help="compile target (default cpu)")
    e.add_argument("--target-arch", dest="target_arch", help="CPU name (default host), ROCm arch (gfx942) or CUDA arch (sm_80)")
    e.add_argument("--compile-flag", dest="compile_flags", action="append", default=[], help="extra iree-compile flag (repeatable)")
    e.add_argument("--seed", type=int, help="seed for preset models' random weights (default 0)")
    e.add_argument("--no-compile", action="store_true", help="stop after MLIR and parameters")
    e.add_argument("--output-dir", required=True, help="output directory (created, or replaced if it is an earlier export)")
    e.add_argument("--json", action="store_true", help="print one JSON object with timings, sizes and transfer counts")
    e.set_defaults(func=cmd_export)
