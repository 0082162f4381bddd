"""`sharktank serve`: an OpenAI-compatible HTTP server over a compiled artifact."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from .common import CliError, add_runtime_options, follow_rank0, multi_host, open_model, text_dir

__all__ = ["add_parser", "cmd_serve", "API_KEY_ENV", "SHUTDOWN_GRACE_S"]

NAME = "serve"
HELP = "serve a compiled directory over an OpenAI-compatible HTTP API"  # the line in `sharktank --help`

# The environment variable --api-key defaults to.
API_KEY_ENV = "SHARKTANK_API_KEY"
# Seconds uvicorn lets open requests finish when it stops (Ctrl-C, SIGTERM, a lost host).
SHUTDOWN_GRACE_S = 5


def _chunk(text: str) -> int | None:
    """``--prefill-chunk``: a positive number of tokens, or ``off``."""
    if text == "off":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 1 or 'off', found {text!r}")
    return n


def _kv_pages(args, model) -> int | None:
    """``--kv-cache-gib`` as pool pages (None: the engine's default), refused when the artifact
    has no paged functions or, on a CPU, when the pool would not fit in the memory available."""
    if args.kv_cache_gib is None:
        return None
    if getattr(model, "page_size", None) is None:
        raise CliError(f"{args.dir}: --kv-cache-gib needs the paged functions (export with --page-size)")
    if args.prefill_chunk is None:
        raise CliError("--kv-cache-gib needs chunked prefill (the paged cache is filled in chunks); drop --prefill-chunk off")
    from ..export.cache_size import host_memory_available

    pages = model.pages_in(args.kv_cache_gib)
    if model.driver in ("local-task", "local-sync"):
        need = (pages + 1) * sum(model.page_bytes().values())
        available = host_memory_available()
        if available is not None and need > available:
            raise CliError(f"--kv-cache-gib {args.kv_cache_gib}: a pool of {pages} pages takes {need / 2**30:.2f} GiB, but this host has {available / 2**30:.2f} GiB available")
    return pages


def _serve_loader(args, distributed: bool, held: dict):
    """Loads the artifact's model, engine and tokenizer (on the server's loading thread);
    ``held`` gets the model (to close at the end) and, when another rank failed, ``rc`` 3."""

    def load():
        from ..runtime.distributed import DistributedError
        from ..serving.engine import Engine
        from ..text import load_tokenizer

        tokenizer = load_tokenizer(text_dir(args.dir, distributed))
        if tokenizer is None:
            raise CliError(f"{args.dir}: the artifact has no tokenizer (its export source carried none); serve needs one to return text")
        try:
            held["model"], _ = open_model(args, distributed)
        except DistributedError:
            held["rc"] = 3
            raise
        engine = Engine(held["model"], batch_size=args.max_batch, max_queue=args.max_queue, chunk_tokens=args.prefill_chunk, kv_pages=_kv_pages(args, held["model"]))
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

    distributed = args.distributed or multi_host(args.dir)
    if distributed:
        from ..runtime.distributed import read_hosts_manifest

        read_hosts_manifest(args.dir)
        if follow_rank0(args):  # rank 0 serves HTTP; the others run its calls
            return 0
    try:
        import uvicorn

        from ..serving.server import create_app
    except ImportError as e:
        raise CliError(f"serve needs the web server packages ({e.name} is missing): pip install 'sharktank[serve]'") from None
    from ..runtime import read_manifest

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


def add_parser(sub) -> None:
    """Declare `sharktank serve` on the subcommand set ``sub``."""
    # Imported here: the serving package reaches torch, which `sharktank --help` must not load.
    from ..serving.scheduler import DEFAULT_CHUNK_TOKENS

    v = sub.add_parser(
        NAME, help=HELP,
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
    v.add_argument(
        "--prefill-chunk", dest="prefill_chunk", type=_chunk, default=DEFAULT_CHUNK_TOKENS, metavar="TOKENS",
        help=f"prompt tokens prefilled per step between decode steps (default {DEFAULT_CHUNK_TOKENS}; 'off': whole prompts): a long prompt "
        "holds running streams up by one chunk a step, and a new request reuses the longest prefix of its prompt a free batch row "
        "still holds (with a paged cache: the longest prefix in its prefix cache). Needs an artifact with prefill_chunk or paged functions "
        "(one microbatch); others prefill whole prompts",
    )
    v.add_argument(
        "--kv-cache-gib", dest="kv_cache_gib", type=float, metavar="GIB",
        help="an artifact exported with --page-size serves from one pool of KV-cache pages shared by all requests (a request takes "
        "pages for its prompt when admitted and one more page each time it fills one; when the pool runs out the most recently "
        "admitted request is preempted and recomputed later, its client seeing only a delay; full prompt pages are kept for reuse "
        "by later prompts with the same prefix): the pool's size per device in GiB (default: the memory of --max-batch rows of "
        "the exported cache length). Refused on a CPU when it exceeds the memory available",
    )
    v.add_argument("--model-name", dest="model_name", help="the model id clients send and /v1/models lists (default DIR's name)")
    v.add_argument("--api-key", dest="api_key", metavar="KEY", help=f"require `Authorization: Bearer KEY` on every /v1 route (401 otherwise); default: the "
        f"{API_KEY_ENV} environment variable (safer: a command line is visible to other users). /health and /metrics stay open "
        "(they carry no prompts or outputs, only status, counts and latencies): keep /metrics off untrusted networks if that matters")
    add_runtime_options(v, serving=True)
    v.add_argument("--log-level", dest="log_level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's log level (default warning)")
    v.set_defaults(func=cmd_serve)
