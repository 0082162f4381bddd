"""The command line as a package: every subcommand declares its options in its own module, the
runtime options are declared once for run and serve, and building the parser imports no
compiler runtime or serving stack (help must not pay for what a command does)."""

from __future__ import annotations

import subprocess
import sys


def _options(parser, name):
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return {a.dest: a for a in sub.choices[name]._actions}


def test_run_and_serve_share_the_runtime_options():
    from sharktank.cli import build_parser
    from sharktank.export.compile import TARGETS
    from sharktank.runtime.distributed import DEFAULT_TIMEOUT_S

    parser = build_parser()
    run, serve = _options(parser, "run"), _options(parser, "serve")
    drivers = [d for t in TARGETS.values() for d in t.drivers]
    for opts in (run, serve):
        assert list(opts["driver"].choices) == drivers and opts["timeout"].default == DEFAULT_TIMEOUT_S
        assert {"distributed", "bind"} <= set(opts)


def test_building_the_parser_loads_no_runtime_server_or_tokenizer():
    code = ("import sys; from sharktank.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('iree.runtime', 'uvicorn', 'fastapi', 'tokenizers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_python_m_sharktank_cli_is_the_command():
    out = subprocess.run([sys.executable, "-m", "sharktank.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("sharktank "), out.stderr[-2000:]
