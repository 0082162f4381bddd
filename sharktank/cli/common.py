"""What every subcommand shares: the user-error type, small parsers of values, progress
messages, the runtime options (`run` and `serve`), and opening an artifact's model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["CliError", "ints", "say", "add_runtime_options", "multi_host", "open_model", "text_dir", "follow_rank0"]


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def ints(text: str, what: str) -> list[int]:
    """Comma-separated integers (``what`` names the option in the error)."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{what} must be comma-separated integers, found {text!r}") from None
    if not values:
        raise CliError(f"{what} is empty")
    return values


def say(args, msg: str) -> None:
    """A progress line on stderr (none with --json, whose stdout is one object)."""
    if not getattr(args, "json", False):
        print(msg, file=sys.stderr, flush=True)


def add_runtime_options(p, *, serving: bool) -> None:
    """--driver, --distributed, --timeout and --bind, declared once for `run` and `serve`."""
    from ..export.compile import TARGETS
    from ..runtime.distributed import DEFAULT_TIMEOUT_S, HEARTBEAT_S

    p.add_argument("--driver", choices=[d for t in TARGETS.values() for d in t.drivers], help="IREE runtime driver (default: the one compiled for). CPU modules run on local-task "
                   "(worker threads; faster for larger work) or local-sync (on the calling thread; faster for small models)")
    role = ("serve a multi-host artifact (`export --hosts`) under torchrun, one rank per host (implied for one): rank 0 serves HTTP "
            "and runs the engine, the other ranks run its calls") if serving else (
            "run one host of a multi-host artifact (`export --hosts`), reading RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as "
            "torchrun sets them (implied for a multi-host artifact); rank 0 prints the output")
    p.add_argument("--distributed", action="store_true", help=role)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"distributed: seconds any rank waits to join or for a message "
                   f"before it gives up naming the rank it waited for (default {DEFAULT_TIMEOUT_S:g}); a rank that exits is noticed at once"
                   + (f", by an idle rank 0 within {HEARTBEAT_S:g} s" if serving else ""))
    p.add_argument("--bind", help="distributed: the address this rank's gloo connections listen on (default MASTER_ADDR on rank 0 or when it is "
                   "a loopback address, else the address of this host's name)")


def multi_host(directory: str) -> bool:
    """Whether ``directory`` holds a multi-host artifact (its readers say what else is wrong)."""
    try:
        from ..export.manifest import HOSTS_FORMAT

        return json.loads((Path(directory) / "manifest.json").read_text()).get("format") == HOSTS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def open_model(args, distributed: bool):
    """``(model, rank)``: the artifact's model, or this rank's share of a multi-host one
    (connected to the other ranks; rank 0 drives it, the others run ``serve()``)."""
    if not distributed:
        from ..runtime import CompiledModel

        return CompiledModel(args.dir, driver=args.driver), 0
    from ..runtime.distributed import DistributedEnv, DistributedModel

    model = DistributedModel(args.dir, DistributedEnv.from_environ(), timeout_s=args.timeout, driver=args.driver, bind=args.bind)
    return model, model.rank


def text_dir(directory: str, distributed: bool) -> Path:
    """Where an artifact's tokenizer is: a multi-host artifact's first host (rank 0) holds it."""
    if not distributed:
        return Path(directory)
    from ..runtime.distributed import read_hosts_manifest

    return read_hosts_manifest(directory).host_dir(0)


def follow_rank0(args) -> bool:
    """On a rank other than 0 of a multi-host run: run rank 0's calls until it stops us, and
    say so (True); on rank 0 or one host, False."""
    from ..runtime.distributed import DistributedEnv

    if DistributedEnv.from_environ().rank == 0:
        return False
    model, _ = open_model(args, True)
    model.serve()
    return True
