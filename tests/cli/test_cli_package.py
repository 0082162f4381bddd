"""The command line as a package: every subcommand declares its options in its own module, the
runtime options are declared once for run and serve, and building the parser imports no
compiler runtime or serving stack (help must not pay for what a command does)."""

from __future__ import annotations

import ast
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


_HEAVY = ("torch", "numpy", "iree")


def _loaded_heavy(argv: list[str]) -> tuple[int, list[str], str]:
    """Run ``sharktank.cli.main(argv)`` in a fresh interpreter: its exit code, heavy packages loaded, stderr."""
    code = (
        "import sys\nfrom sharktank.cli import main\n"
        f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
        f"print(rc, sorted({{m.split('.')[0] for m in sys.modules}} & set({_HEAVY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rc, loaded = out.stdout.strip().splitlines()[-1].split(" ", 1)
    return int(rc), ast.literal_eval(loaded), out.stderr


def test_help_and_inspect_import_neither_torch_nor_iree(tmp_path):
    # The top-level help lists every command without declaring (importing) their options.
    rc, loaded, _ = _loaded_heavy(["--help"])
    assert rc == 0 and loaded == []
    art = tmp_path / "art"
    out = subprocess.run([sys.executable, "-m", "sharktank.cli", "export", "--model", "toy-llama", "--tp", "2",
                          "--no-compile", "--output-dir", str(art)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rc, loaded, _ = _loaded_heavy(["inspect", str(art)])
    assert rc == 0 and loaded == []
    # A user error is still one line and exit 2 (its class is imported only once it happened).
    rc, _, err = _loaded_heavy(["inspect", str(tmp_path)])
    assert rc == 2 and err.startswith("sharktank inspect: error:") and "Traceback" not in err


def test_one_command_declared_alone_keeps_the_others_choosable():
    from sharktank.cli import build_parser

    parser = build_parser(only="compile")
    assert {"dir", "target", "compile_flags"} <= set(_options(parser, "compile"))
    assert _options(parser, "run") == {}  # declared by name only: no -h, no options
    out = subprocess.run([sys.executable, "-m", "sharktank.cli", "nosuch"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice: 'nosuch'" in out.stderr and "inspect" in out.stderr


def test_lazy_package_names_are_what_their_homes_define_even_after_the_submodules_load():
    import importlib
    import pkgutil

    import sharktank

    lazy = [m for m in pkgutil.iter_modules(sharktank.__path__) if m.ispkg]
    checked = 0
    for info in lazy:
        package = importlib.import_module(f"sharktank.{info.name}")
        homes = getattr(package, "_HOMES", None)
        if homes is None:
            continue
        submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        assert not set(homes) & submodules, f"{package.__name__}: names shadowed by submodules"
        for name, home in homes.items():
            module = importlib.import_module(f"{package.__name__}.{home}")  # as any importer might first
            assert getattr(package, name) is getattr(module, name), f"{package.__name__}.{name}"
            assert name in dir(package)
        checked += 1
    assert checked >= 5
