"""The ``sharktank`` command line: export, compile, run and inspect sharded models."""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import tomllib
from pathlib import Path

from . import __version__

_RECIPE_KEYS = {"model", "tp", "ep", "pp", "hosts", "placement", "batch_sizes", "max_seq_len", "dtype", "target", "target_arch", "compile_flags", "seed"}
_DEFAULTS = {"tp": 1, "ep": 1, "pp": None, "hosts": None, "placement": None, "batch_sizes": "1", "max_seq_len": None, "dtype": None, "target": "cpu", "target_arch": None, "compile_flags": [], "seed": 0}


# serve: the environment variable --api-key defaults to.
API_KEY_ENV = "SHARKTANK_API_KEY"
# serve: seconds uvicorn lets open requests finish when it stops (Ctrl-C, SIGTERM, a lost host).
SHUTDOWN_GRACE_S = 5


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{what} must be comma-separated integers, found {text!r}") from None
    if not values:
        raise CliError(f"{what} is empty")
    return values


def _say(args, msg: str) -> None:
    if not getattr(args, "json", False):
        print(msg, file=sys.stderr, flush=True)


# --- export ------------------------------------------------------------------------------------
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
    if isinstance(recipe.get("batch_sizes"), list):
        recipe["batch_sizes"] = ",".join(str(b) for b in recipe["batch_sizes"])
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

    from .export.artifact import export_artifact
    from .export.manifest import HostsManifest
    from .models import load_model

    s = _export_settings(args)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if s["dtype"] is not None and s["dtype"] not in dtypes:
        raise CliError(f"--dtype must be one of {sorted(dtypes)}, found {s['dtype']!r}")
    ep = f", ep={s['ep']}" if int(s["ep"]) > 1 else ""
    _say(args, f"loading {s['model']} (tp={s['tp']}{ep}, pp={s['pp'] or 1}{', placement ' + str(s['placement']) if s['placement'] else ''})")
    model = load_model(
        s["model"], tp=int(s["tp"]), ep=int(s["ep"]), pp=s["pp"] and int(s["pp"]), placement=s["placement"],
        dtype=dtypes.get(s["dtype"]) if s["dtype"] else None, seed=int(s["seed"]), deferred=True,
    )
    _say(args, model.plan.describe())
    options = dict(
        source=str(s["model"]),
        batch_sizes=tuple(_ints(s["batch_sizes"], "--batch-sizes")),
        max_seq_len=s["max_seq_len"] and int(s["max_seq_len"]),
        target=s["target"],
        target_arch=s["target_arch"],
        extra_flags=tuple(s["compile_flags"]),
        compile=not args.no_compile,
        progress=lambda m: _say(args, m),
    )
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


# --- compile -----------------------------------------------------------------------------------
def cmd_compile(args) -> int:
    from .export.artifact import compile_artifact

    manifest = compile_artifact(
        args.dir, target=args.target, target_arch=args.target_arch, extra_flags=tuple(args.compile_flags or ()),
        progress=lambda m: _say(args, m),
    )
    print(f"compiled {args.dir} for {manifest.compile['target']} in {manifest.compile['seconds']:.1f} s")
    return 0


# --- run ---------------------------------------------------------------------------------------
def _eager_model(manifest):
    from .models.llama.model import LlamaModel
    from .models.loading import load_weights
    from .parallel import ParallelPlan

    _, theta = load_weights(manifest.source)
    import torch

    dtype = getattr(torch, manifest.dtype)
    theta = theta.map(lambda _, t: t.to(dtype) if t.is_floating_point() else t)
    plan = ParallelPlan.from_dict(manifest.parallel)
    from .models.llama.config import LlamaConfig

    return LlamaModel(LlamaConfig.from_dict(manifest.config), theta, plan, experts=manifest.experts or "ffn")


def _seconds_since_process_start(at: float) -> float | None:
    """Seconds from this process's start to the ``time.perf_counter()`` value ``at`` (Linux:
    from /proc, to a clock tick; None elsewhere)."""
    import os

    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start - (time.perf_counter() - at)


def _multi_host(directory: str) -> bool:
    try:
        return json.loads((Path(directory) / "manifest.json").read_text()).get("format") == "sharktank.hosts"
    except (OSError, ValueError, AttributeError):
        return False  # the one-host reader says what is wrong


def _timings(model, t0: float, loaded: float) -> dict:
    decode = [t * 1e3 for t in model.timings["decode"]]
    started = _seconds_since_process_start(loaded)
    return {
        "prefill_ms": round(model.timings["prefill"][0] * 1e3, 3),
        "decode_ms_per_token": {
            "median": round(statistics.median(decode), 3) if decode else None,
            "min": round(min(decode), 3) if decode else None,
            "max": round(max(decode), 3) if decode else None,
        },
        "load_s": round(loaded - t0, 3),
        # From the process's start (interpreter and imports included) to the first token's logits.
        "first_token_s": round(started + model.timings["prefill"][0], 3) if started is not None else None,
        "device_count": model.device_count,
        "dtype": model.manifest.dtype,
        "driver": model.driver,
    }


def _open_model(args, distributed: bool):
    """``(model, rank)``: the artifact's model, or this rank's share of a multi-host one
    (connected to the other ranks; rank 0 drives it, the others run ``serve()``)."""
    if not distributed:
        from .runtime import CompiledModel

        return CompiledModel(args.dir, driver=args.driver), 0
    from .runtime.distributed import DistributedEnv, DistributedModel

    model = DistributedModel(args.dir, DistributedEnv.from_environ(), timeout_s=args.timeout, driver=args.driver, bind=args.bind)
    return model, model.rank


def _text_dir(directory: str, distributed: bool) -> Path:
    """Where an artifact's tokenizer is: a multi-host artifact's first host (rank 0) holds it."""
    if not distributed:
        return Path(directory)
    from .runtime.distributed import read_hosts_manifest

    return read_hosts_manifest(directory).host_dir(0)


def _run_prompt(args, distributed: bool) -> int:
    from .text import SamplingParams, load_tokenizer
    from .text.generate import generate_text

    if distributed:
        from .runtime.distributed import DistributedEnv

        if DistributedEnv.from_environ().rank != 0:  # rank 0 owns the text: the others open no tokenizer
            model, _ = _open_model(args, True)
            model.serve()
            return 0
    tokenizer = load_tokenizer(_text_dir(args.dir, distributed))
    if tokenizer is None:
        raise CliError(f"{args.dir}: the artifact has no tokenizer (its export source carried none); give token ids with --tokens")
    try:
        params = SamplingParams(
            max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, stop_token_ids=tokenizer.eos_token_ids,
        )
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    except ValueError as e:
        raise CliError(str(e)) from None
    # A chat template writes the BOS token itself.
    prompt_ids = tokenizer.encode(text, add_special_tokens=not args.chat)
    if not prompt_ids:
        raise CliError("--prompt encodes to no tokens")
    t0 = time.perf_counter()
    model, _ = _open_model(args, distributed)
    loaded = time.perf_counter()
    try:
        limit = min(f.max_seq_len for f in model.functions.values())
        if len(prompt_ids) + params.max_tokens > limit:
            raise CliError(f"the prompt's {len(prompt_ids)} tokens + --max-new-tokens {params.max_tokens} exceed the exported cache length {limit}")
        show = (lambda piece: None) if args.json else (lambda piece: print(piece, end="", flush=True))
        gen = generate_text(model, tokenizer, prompt_ids, params, stop=args.stop, on_text=show)
    finally:
        if distributed:
            model.close()  # stops the other ranks (also after an error here)
    result = {"text": gen.text, "ids": gen.ids, "prompt_ids": prompt_ids, "finish_reason": gen.finish_reason, **_timings(model, t0, loaded)}
    if distributed:
        result["hosts"] = model.world_size
    if args.json:
        print(json.dumps(result))
    else:
        print()
        d = result["decode_ms_per_token"]
        _say(args, f"{len(gen.ids)} tokens ({gen.finish_reason}); prefill {result['prefill_ms']:.2f} ms; decode {d['median']} ms/token")
    return 0


def cmd_run(args) -> int:
    import numpy as np
    import torch

    distributed = args.distributed or _multi_host(args.dir)
    if args.prompt is not None:
        return _run_prompt(args, distributed)
    rows = [_ints(r, "--tokens") for r in args.tokens.split(";")]
    if len({len(r) for r in rows}) != 1:
        raise CliError(f"--tokens: every sequence must have the same length, found {[len(r) for r in rows]}")
    tokens = torch.tensor(rows, dtype=torch.int64)
    t0 = time.perf_counter()
    model, rank = _open_model(args, distributed)
    if rank != 0:
        model.serve()  # rank 0 owns the prompt and the output
        return 0
    loaded = time.perf_counter()
    ids, logits = model.generate(tokens, args.max_new_tokens)
    result = {"ids": ids.tolist() if len(rows) > 1 else ids[0].tolist(), **_timings(model, t0, loaded)}
    if distributed:
        model.close()
        # Bytes each rank sent, per decode step: what crossed hosts for one token.
        steps = max(model.traffic[0]["steps"]["decode"], 1)
        result["hosts"] = model.world_size
        result["bytes_per_decode_token"] = {r: t["decode"] // steps for r, t in model.traffic.items()}
    if args.compare_eager:
        eager = _eager_model(model.manifest)
        eager_ids = eager.generate(tokens, args.max_new_tokens)
        # Compare step logits on the compiled module's own token path.
        full = torch.cat([tokens, ids[:, :-1]], dim=1) if args.max_new_tokens > 1 else tokens
        want = eager.prefill(full)[:, tokens.shape[1] - 1 :]
        result["max_abs_error_vs_eager"] = float((logits.float() - want.float()).abs().max())
        result["eager_ids_match"] = bool(torch.equal(eager_ids, ids))
    if args.save_logits:
        from .weights._files import atomic_file

        with atomic_file(args.save_logits) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, logits.float().numpy())
    if args.json:
        print(json.dumps(result))
    else:
        for row in ids.tolist():
            print("generated ids:", " ".join(map(str, row)))
        d = result["decode_ms_per_token"]
        print(f"prefill {result['prefill_ms']:.2f} ms; decode {d['median']} ms/token (min {d['min']}, max {d['max']})")
        if result["first_token_s"] is not None:
            print(f"loaded in {result['load_s']:.2f} s; first token {result['first_token_s']:.2f} s after the process started")
        if args.compare_eager:
            print(f"max abs error vs eager torch: {result['max_abs_error_vs_eager']:.3g}; same ids as eager: {result['eager_ids_match']}")
    return 0


# --- quantize ----------------------------------------------------------------------------------
def cmd_quantize(args) -> int:
    from .models.loading import weight_source
    from .models import quantize_gguf

    out = Path(args.output)
    if out.suffix != ".gguf":
        raise CliError(f"OUTPUT must be a .gguf file, found {out}")
    if out.exists() and not args.force:
        raise CliError(f"{out} exists (--force replaces it)")
    t0 = time.perf_counter()
    config, source = weight_source(args.input)
    counts = quantize_gguf(out, config, source, to=args.to, progress=lambda m: _say(args, m))
    summary = {"output": str(out), "bytes": out.stat().st_size, "tensors_by_type": counts, "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        print(f"wrote {out}: {summary['bytes'] / 1e6:.1f} MB ({kinds}) in {summary['seconds']:.1f} s")
    return 0


# --- perplexity --------------------------------------------------------------------------------
def cmd_perplexity(args) -> int:
    from .evaluate import PerplexityError, bos_to_add, check_window, open_target, perplexity

    text_path = Path(args.text)
    if not text_path.is_file():
        raise CliError(f"--text {text_path}: no such file")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"--text {text_path}: not UTF-8 text ({e})") from None
    target = open_target(args.target)
    try:
        ids = target.tokenizer.encode(text, add_special_tokens=True)
        bos = bos_to_add(target.tokenizer)
        check_window(args.window, len(ids), target.max_seq_len)  # before the weights load
        _say(args, f"{len(ids)} tokens; loading {args.target} ({target.kind})")
        logits_of = target.load()

        def progress(done: int, total: int, ppl: float, tok_s: float) -> None:
            _say(args, f"[{done}/{total}] perplexity {ppl:.4f} ({tok_s:.0f} tok/s)")

        result = perplexity(logits_of, ids, args.window, bos_id=bos, max_seq_len=target.max_seq_len, on_chunk=progress)
    except PerplexityError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps({**result.to_dict(), "tokens": len(ids), "bos_id": bos, "model": str(args.target), "kind": target.kind}))
    else:
        print(f"perplexity: {result.ppl:.4f} ({result.tokens_scored} tokens scored in {result.chunks} chunks of {result.window}, {result.tokens_per_s:.0f} tok/s)")
    return 0


# --- inspect -----------------------------------------------------------------------------------
def _device_bytes(directory: str) -> tuple[object, dict[int, int]]:
    """``(manifest, parameter bytes per global device)`` of a one-program or multi-host artifact."""
    from .export.manifest import HostsManifest, Manifest, read_any

    m = read_any(directory)
    if isinstance(m, Manifest):
        return m, {f["device"]: f["size"] for f in m.parameters["files"].values()}
    assert isinstance(m, HostsManifest)
    sizes: dict[int, int] = {}
    for h in m.hosts:
        local = {l: g for g, l in h.data["devices"]}
        for f in Manifest.read(m.host_dir(h.host)).parameters["files"].values():
            sizes[local[f["device"]]] = sizes.get(local[f["device"]], 0) + f["size"]
    return m, sizes


def cmd_inspect(args) -> int:
    from .export.manifest import HostsManifest
    from .parallel.drawing import draw_svg, draw_text

    m, per_device = _device_bytes(args.dir)
    p = m.data["parallel"]
    if args.svg:
        from .weights._files import atomic_file

        with atomic_file(args.svg) as tmp:
            Path(tmp).write_text(draw_svg(p, per_device, title=f"{Path(args.dir).resolve().name}: tp={p['tp']} pp={p['pp']}"))
    if isinstance(m, HostsManifest):
        info = {
            "model": m.data["model"]["source"], "dtype": m.dtype, "tp": p["tp"], "pp": p["pp"], "hosts": len(m.hosts),
            "parameter_bytes_per_device": {str(d): b for d, b in sorted(per_device.items())},
            "host_dirs": [h.dir for h in m.hosts],
        }
        if args.json:
            print(json.dumps(info))
            return 0
        print(f"{info['model']} ({info['dtype']}), tp={info['tp']} pp={info['pp']}, over {info['hosts']} hosts ({', '.join(info['host_dirs'])}: inspect each for its program)")
        print(draw_text(p, per_device))
        return 0
    info = {
        "model": m.source,
        "dtype": m.dtype,
        "tp": p["tp"],
        "pp": p["pp"],
        "device_count": m.device_count,
        "stages": [{"stage": s, "blocks": [b for b, x in enumerate(p["stage_of_block"]) if x == s], "devices": reps} for s, reps in enumerate(p["replicas"])],
        "paths": p["paths"],
        "parameter_bytes_per_device": {str(d): b for d, b in per_device.items()},
        "transfers": m.transfers,
        "functions": sorted(m.functions),
        "compile": m.compile,
        "versions": m.versions,
        "tokenizer": m.tokenizer,
        "experts": m.experts,
    }
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{info['model']} ({info['dtype']}), {info['device_count']} devices")
    print(draw_text(p, per_device))
    c = m.config
    if c.get("num_experts"):
        split = "whole experts per device over each tensor-parallel group" if m.experts == "experts" else "each expert split as the dense FFN"
        print(f"experts: {c['num_experts']} per block, {c['num_experts_per_tok']} per token; {split}")
    print("transfers per function:", ", ".join(f"{k}: {v}" for k, v in info["transfers"].items()))
    tok = info["tokenizer"]
    print("tokenizer:", "none (token ids only)" if tok is None else tok["kind"] + (f" {tok['file']}, EOS ids {tok['eos_token_ids']}" if tok["kind"] == "hf" else ""))
    if m.compile:
        print(f"compiled for {m.compile['target']} in {m.compile['seconds']} s with:", " ".join(m.compile["flags"]))
    else:
        print("not compiled (run `sharktank compile`)")
    return 0


# --- serve -------------------------------------------------------------------------------------
def _serve_loader(args, distributed: bool, held: dict):
    """Loads the artifact's model, engine and tokenizer (on the server's loading thread);
    ``held`` gets the model (to close at the end) and, when another rank failed, ``rc`` 3."""

    def load():
        from .runtime.distributed import DistributedError
        from .serving.engine import Engine
        from .text import load_tokenizer

        tokenizer = load_tokenizer(_text_dir(args.dir, distributed))
        if tokenizer is None:
            raise CliError(f"{args.dir}: the artifact has no tokenizer (its export source carried none); serve needs one to return text")
        try:
            held["model"], _ = _open_model(args, distributed)
        except DistributedError:
            held["rc"] = 3
            raise
        engine = Engine(held["model"], batch_size=args.max_batch, max_queue=args.max_queue)
        return engine, tokenizer

    return load


def _watch(server, state, args, host: str, held: dict) -> None:
    """Print the URL once the model is loaded and the socket bound; stop the server if loading
    failed or, later, the engine lost its model (exit status 3: a host of the artifact failed)."""
    announced = False
    while not server.should_exit:
        if state.error or state.failure:
            print(f"sharktank serve: error: {state.error or state.failure}", file=sys.stderr, flush=True)
            if state.failure:
                held["rc"] = 3
            server.should_exit = True
            return
        if not announced and state.ready.is_set() and server.started:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
            print(f"serving {state.model_name} at http://{host}:{port}/v1 (health: http://{host}:{port}/health); Ctrl-C stops", flush=True)
            announced = True
        time.sleep(0.05)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def cmd_serve(args) -> int:
    import os
    import threading

    distributed = args.distributed or _multi_host(args.dir)
    if distributed:
        from .runtime.distributed import DistributedEnv, read_hosts_manifest

        read_hosts_manifest(args.dir)
        if DistributedEnv.from_environ().rank != 0:  # rank 0 serves HTTP; the others run its calls
            model, _ = _open_model(args, True)
            model.serve()
            return 0
    try:
        import uvicorn

        from .serving.server import create_app
    except ImportError as e:
        raise CliError(f"serve needs the web server packages ({e.name} is missing): pip install 'sharktank[serve]'") from None
    from .runtime import read_manifest

    if not distributed:
        read_manifest(args.dir)  # not an artifact: one line now, not after the server started
    if args.max_queue < 0:
        raise CliError(f"--max-queue must be >= 0, found {args.max_queue}")
    name = args.model_name or Path(args.dir).resolve().name
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise CliError(f"--api-key (or {API_KEY_ENV}) must not be empty")
    held: dict = {}
    app = create_app(None, None, name, load=_serve_loader(args, distributed, held), api_key=api_key)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"sharktank serve: warning: listening on {args.host}: the API has no authentication; anyone who can reach this port can use it", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    host = f"[{args.host}]" if ":" in args.host else args.host
    threading.Thread(target=_watch, args=(server, app.state.serving, args, host, held), daemon=True).start()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: exit through the finally
    # below (which stops the other ranks) instead of dying of it.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server.run()
    finally:
        if distributed and "model" in held:
            held["model"].close()  # stops the other ranks (nothing to do when one was lost)
    return held.get("rc") or (2 if app.state.serving.error or not server.started else 0)


# --- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .export.cache_size import DEFAULT_MAX_SEQ_LEN
    from .export.compile import TARGETS
    from .models import SOURCES_HELP
    from .runtime.distributed import DEFAULT_TIMEOUT_S, HEARTBEAT_S

    parser = argparse.ArgumentParser(
        prog="sharktank",
        description=(
            "Shard inference models across devices (tensor and pipeline parallelism), export them "
            "to one multi-device IREE program, compile and run them."
        ),
    )
    parser.add_argument("--version", action="version", version=f"sharktank {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    e = sub.add_parser(
        "export",
        help="export (and compile) a sharded model to a directory",
        description="Export a model sharded tp-way over pp pipeline stages (or as a placement file says) "
        "to DIR: model.mlir, model.vmfb, one device_N.irpa of weight shards per device, manifest.json. "
        "The previous DIR is kept intact if anything fails.",
    )
    e.add_argument("--model", help=f"what to export: {SOURCES_HELP}")
    e.add_argument("--recipe", help="a TOML recipe (e.g. exports/toy-llama-tp2-pp2.toml); flags override its keys")
    e.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    e.add_argument("--ep", type=int, help="a mixture of experts: 1 (default; each expert split tp-way as the dense FFN) or the "
                   "tp size (expert parallelism: whole experts per device over each tensor-parallel group; the expert count must divide by it)")
    e.add_argument("--pp", type=int, help="pipeline stages (default 1, or the placement's)")
    e.add_argument("--hosts", type=int, help="split the pipeline stages over this many hosts (must divide pp): one program per host in "
        "DIR/host_N/, run with torchrun (default: one program, or the hosts the placement names, which --hosts must then match)")
    e.add_argument("--placement", help="placement directives (JSON: place/path directives); a \"host\" in every place directive "
        "exports one program per host, each host holding consecutive stages (as many as it names, e.g. exports/placements/tp2-pp4-hosts-3-1.json)")
    e.add_argument("--batch-sizes", dest="batch_sizes", help="comma-separated batch sizes to export (default 1)")
    e.add_argument("--max-seq-len", dest="max_seq_len", type=int, help=f"KV-cache length (default: the model's context, at most {DEFAULT_MAX_SEQ_LEN}; refused when it and the "
        "weights would not fit in this host's memory for a CPU target)")
    e.add_argument(
        "--dtype",
        help="convert the weights (and so the activations) to float32, float16 or bfloat16 (default: as stored; quantized "
        "GGUF blocks stay blocks). On a CPU, float16 computes slowly (no float16 arithmetic: each product widens its "
        "operands), so an F16 GGUF prefills faster exported with --dtype bfloat16 (the 1B shape: about 1.3-1.8 s against 4.1 s "
        "for 128 tokens on 2 cores), at bfloat16's rounding: 8 mantissa bits to float16's 11, so its logits stray further "
        "from float32's (tools/half_precision_table.py measures both)",
    )
    e.add_argument("--target", choices=list(TARGETS), help="compile target (default cpu)")
    e.add_argument("--target-arch", dest="target_arch", help="CPU name (default host), ROCm arch (gfx942) or CUDA arch (sm_80)")
    e.add_argument("--compile-flag", dest="compile_flags", action="append", default=[], help="extra iree-compile flag (repeatable)")
    e.add_argument("--seed", type=int, help="seed for preset models' random weights (default 0)")
    e.add_argument("--no-compile", action="store_true", help="stop after MLIR and parameters")
    e.add_argument("--output-dir", required=True, help="output directory (created, or replaced if it is an earlier export)")
    e.add_argument("--json", action="store_true", help="print one JSON object with timings, sizes and transfer counts")
    e.set_defaults(func=cmd_export)

    c = sub.add_parser("compile", help="(re)compile an exported directory", description="Compile DIR/model.mlir to DIR/model.vmfb. A model exported for cpu (this host) calls hand-written CPU dispatches (the manifest's module.cpu_kernels: decode attention, and a quantized model's products), written for this host's CPU: it compiles for cpu and this host only; export it again for a GPU target or another --target-arch.")
    c.add_argument("dir", help="an export directory (from `sharktank export`)")
    c.add_argument("--target", choices=list(TARGETS), help="compile target (default: as exported)")
    c.add_argument("--target-arch", dest="target_arch", help="CPU name, ROCm arch or CUDA arch")
    c.add_argument("--compile-flag", dest="compile_flags", action="append", default=[], help="extra iree-compile flag (repeatable)")
    c.set_defaults(func=cmd_compile, json=False)

    r = sub.add_parser(
        "run", help="generate with a compiled directory: token ids (greedy) or text",
        description="Prefill the prompt, then decode on the compiled module: --tokens takes ids and decodes greedily; "
        "--prompt takes text (encoded with the tokenizer the export copied), samples as --temperature/--top-k/--top-p/--seed say, "
        "stops at the tokenizer's EOS ids or a --stop string and prints the text.",
    )
    r.add_argument("dir", help="a compiled export directory (from `sharktank export`)")
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", help="prompt token ids, comma-separated; several sequences of one length separated by ';' (the batch must be an exported batch size)")
    what.add_argument("--prompt", help="prompt text (batch 1; needs an artifact with a tokenizer); prints the generated text")
    r.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate (default 8)")
    r.add_argument("--temperature", type=float, default=0.0, help="--prompt: sampling temperature (default 0: greedy)")
    r.add_argument("--top-k", dest="top_k", type=int, default=0, help="--prompt: sample among the k most likely tokens (default 0: all)")
    r.add_argument("--top-p", dest="top_p", type=float, default=1.0, help="--prompt: sample among the most likely tokens of this total probability (default 1)")
    r.add_argument("--seed", type=int, help="--prompt: sampling seed (default: random)")
    r.add_argument("--stop", action="append", default=[], help="--prompt: stop before this text (repeatable)")
    r.add_argument("--chat", action="store_true", help="--prompt: wrap the prompt as a user message in the tokenizer's chat template")
    r.add_argument("--compare-eager", action="store_true", help="also run eager torch and print the max logit error")
    r.add_argument(
        "--driver",
        choices=[d for t in TARGETS.values() for d in t.drivers],
        help="IREE runtime driver (default: the one compiled for). CPU modules run on local-task "
        "(worker threads; faster for larger work) or local-sync (on the calling thread; faster for small models)",
    )
    r.add_argument("--distributed", action="store_true", help="run one host of a multi-host artifact (`export --hosts`), reading RANK, WORLD_SIZE, "
        "MASTER_ADDR and MASTER_PORT as torchrun sets them (implied for a multi-host artifact); rank 0 prints the output")
    r.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"distributed: seconds any rank waits to join or for a message before it "
        f"gives up naming the rank it waited for (default {DEFAULT_TIMEOUT_S:g}); a rank that exits is noticed at once")
    r.add_argument("--bind", help="distributed: the address this rank's gloo connections listen on (default MASTER_ADDR on rank 0 or when it is "
        "a loopback address, else the address of this host's name)")
    r.add_argument("--save-logits", help="write the logits of every step to this .npy file")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_run)

    v = sub.add_parser(
        "serve", help="serve a compiled directory over an OpenAI-compatible HTTP API",
        description="Load DIR and serve /v1/completions, /v1/chat/completions (when the tokenizer has a chat template), "
        "/v1/models and /health (503 while loading, then 200). Requests are batched by the engine: up to --max-batch "
        "generate together, up to --max-queue more wait, and any beyond get 429. GET /metrics answers Prometheus text. "
        "Without --api-key the API has no authentication; it listens on 127.0.0.1 unless --host says otherwise.",
    )
    v.add_argument("dir", help="a compiled export directory with a tokenizer (from `sharktank export`)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)")
    v.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one, printed when ready)")
    v.add_argument("--max-batch", dest="max_batch", type=int, help="requests generating at once: one of the exported batch sizes (default the largest)")
    v.add_argument("--max-queue", dest="max_queue", type=int, default=64, help="requests waiting for a free batch row before new ones get 429 (default 64)")
    v.add_argument("--model-name", dest="model_name", help="the model id clients send and /v1/models lists (default DIR's name)")
    v.add_argument("--api-key", dest="api_key", metavar="KEY", help=f"require `Authorization: Bearer KEY` on every /v1 route (401 otherwise); default: the "
        f"{API_KEY_ENV} environment variable (safer: a command line is visible to other users). /health and /metrics stay open "
        "(they carry no prompts or outputs, only status, counts and latencies): keep /metrics off untrusted networks if that matters")
    v.add_argument(
        "--driver", choices=[d for t in TARGETS.values() for d in t.drivers],
        help="IREE runtime driver (default: the one compiled for; CPU: local-task or local-sync)",
    )
    v.add_argument("--distributed", action="store_true", help="serve a multi-host artifact (`export --hosts`) under torchrun, one rank per host "
        "(implied for one): rank 0 serves HTTP and runs the engine, the other ranks run its calls")
    v.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"distributed: seconds any rank waits to join or for a message "
        f"(default {DEFAULT_TIMEOUT_S:g}); a rank that exits is noticed at once, by an idle rank 0 within {HEARTBEAT_S:g} s")
    v.add_argument("--bind", help="distributed: the address this rank's gloo connections listen on (as for run)")
    v.add_argument("--log-level", dest="log_level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's log level (default warning)")
    v.set_defaults(func=cmd_serve)

    i = sub.add_parser(
        "inspect", help="describe an exported directory (and draw its placement)",
        description="Draw the placement (devices as columns, pipeline stages as rows, each cell the microbatch paths "
        "A, B, ... that run that stage on that device, so a letter read down the rows is one path's route; the "
        "parameter bytes each device holds), then transfers per function, the tokenizer and the compile flags. "
        "A multi-host artifact's top directory draws the whole plan with each stage's host.",
    )
    i.add_argument("dir", help="an export directory (from `sharktank export`, one program or --hosts)")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--svg", metavar="FILE", help="also write the drawing as an SVG picture to FILE")
    i.set_defaults(func=cmd_inspect)

    from .evaluate import METHOD

    pp = sub.add_parser(
        "perplexity", help="perplexity of a text file, as llama.cpp's llama-perplexity computes it",
        description=f"Perplexity of the text in FILE under the model DIR|MODEL. {METHOD} A compiled artifact runs each chunk as one "
        "prefill (logits of every position); a model source runs eagerly in torch.",
    )
    pp.add_argument("target", metavar="DIR|MODEL", help=f"a compiled export directory with a tokenizer, or a model: {SOURCES_HELP}")
    pp.add_argument("--text", required=True, metavar="FILE", help="the UTF-8 text to score (at least one window of tokens)")
    pp.add_argument("--window", type=int, default=512, help="tokens per chunk (llama.cpp's -c): even, at most the model's or artifact's "
        "max_seq_len (default 512)")
    pp.add_argument("--json", action="store_true", help="print one JSON object (ppl, nll, tokens scored, chunks, window, tokens/s, running ppl per chunk)")
    pp.set_defaults(func=cmd_perplexity)

    from .weights import QUANTIZE_TO

    q = sub.add_parser(
        "quantize",
        help="write a model as a quantized GGUF",
        description="Quantize a model's 2-D weights with the gguf package's own quantizers and write a llama GGUF "
        "(norms and biases stay float32; weights whose rows are not whole blocks, or already quantized, are kept). "
        "Reads and writes one tensor at a time. K-quants (Q4_K, Q6_K) load but are not made here.",
    )
    q.add_argument("input", help=f"the model: {SOURCES_HELP}")
    q.add_argument("output", help="the .gguf file to write (written beside and renamed into place)")
    q.add_argument("--to", required=True, choices=sorted(QUANTIZE_TO), help="the quantization")
    q.add_argument("--force", action="store_true", help="replace an existing OUTPUT")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=cmd_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .export.cache_size import CacheSizeError
    from .parallel import PlanError
    from .runtime import ArtifactError, InputError
    from .runtime.distributed import DistributedError
    from .text import TokenizerError
    from .weights import WeightsError

    try:
        return args.func(args)
    except (CliError, ArtifactError, InputError, WeightsError, PlanError, CacheSizeError, TokenizerError, FileExistsError) as e:
        # User errors: one line, exit 2. Anything else is a bug and keeps its traceback.
        print(f"sharktank {args.command}: error: {e}", file=sys.stderr)
        return 2
    except DistributedError as e:
        # Another rank failed, hung or never joined: one line naming it, exit 3.
        print(f"sharktank {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 3
    except Exception as e:
        # A compiler rejection (bad --compile-flag, unsupported target) is the user's input: one line.
        if type(e).__name__ != "CompilerToolError":
            raise
        first = next((line for line in str(e).splitlines() if "error:" in line or "Unknown" in line), str(e).splitlines()[0])
        print(f"sharktank {args.command}: error: iree-compile failed: {first.strip()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sharktank {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
