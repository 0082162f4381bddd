"""`sharktank compile`: (re)compile an artifact's MLIR in place."""

from __future__ import annotations

from .common import say

__all__ = ["add_parser", "cmd_compile"]

NAME = "compile"
HELP = "(re)compile an exported directory"  # the line in `sharktank --help`


def cmd_compile(args) -> int:
    from ..export.artifact import compile_artifact

    manifest = compile_artifact(
        args.dir, target=args.target, target_arch=args.target_arch, extra_flags=tuple(args.compile_flags or ()),
        progress=lambda m: say(args, m),
    )
    print(f"compiled {args.dir} for {manifest.compile['target']} in {manifest.compile['seconds']:.1f} s")
    return 0


def add_parser(sub) -> None:
    """Declare `sharktank compile` on the subcommand set ``sub``."""
    from ..export.compile import TARGETS

    c = sub.add_parser(
        NAME, help=HELP, description="Compile DIR/model.mlir to DIR/model.vmfb. A model exported for cpu (this host) calls hand-written CPU dispatches (the manifest's module.cpu_kernels: decode attention, and a quantized model's products), written for this host's CPU: it compiles for cpu and this host only; export it again for a GPU target or another --target-arch.")
    c.add_argument("dir", help="an export directory (from `sharktank export`)")
    c.add_argument("--target", choices=list(TARGETS), help="compile target (default: as exported)")
    c.add_argument("--target-arch", dest="target_arch", help="CPU name, ROCm arch or CUDA arch")
    c.add_argument("--compile-flag", dest="compile_flags", action="append", default=[], help="extra iree-compile flag (repeatable)")
    c.set_defaults(func=cmd_compile, json=False)
