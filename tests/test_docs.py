"""The docs say what the code does: every `sharktank` command and flag shown in README.md and
docs/ exists in the real parser, every docs page is linked from README.md, and every relative
link leads to a file."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "tools" / "README.md"]
# A command starts a line, follows a path (.venv/bin/sharktank), `&&` or torchrun's -m; it runs
# to the end of its line and the indented lines continuing it, or to the next `&&` or `|`.
COMMAND = re.compile(r"(?:^[ \t]*|/|&& |-m )sharktank(?:\.cli)?\s+([a-z]+)((?:[^\n&|]|\n[ \t]+)*)", re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def subcommands() -> dict[str, set[str]]:
    from sharktank.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def shown_commands(text: str) -> list[tuple[str, list[str]]]:
    """``(subcommand, flags)`` of every `sharktank SUB ...` in code: fenced blocks (a line
    continued by indented lines, as the synopsis writes them) and inline spans."""
    found = []
    blocks = re.findall(r"```(?:bash|text|sh)?\n(.*?)```", text, flags=re.S)  # not python: its comments are prose
    for block in blocks + re.findall(r"`((?:\.venv/bin/)?sharktank [^`\n]*)`", text):
        for m in COMMAND.finditer(block):
            found.append((m[1], re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m[2])))
    return found


def test_the_pages_show_commands_at_all():
    shown = [c for page in PAGES for c in shown_commands(page.read_text())]
    # The synopsis alone names every subcommand.
    assert {name for name, _ in shown} >= set(subcommands()) - {"help"}
    assert len(shown) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_and_flag_shown_exists(page):
    commands = subcommands()
    for name, flags in shown_commands(page.read_text()):
        assert name in commands, f"{page.name}: `sharktank {name}` is not a subcommand ({sorted(commands)})"
        unknown = [f for f in flags if f not in commands[name]]
        assert not unknown, f"{page.name}: `sharktank {name}` has no {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name}: link to {target} leads nowhere"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / t).resolve() for t in LINK.findall(readme)}
    for page in (ROOT / "docs").rglob("*.md"):
        assert page.resolve() in linked, f"{page.relative_to(ROOT)} is not linked from README.md"


def test_the_reader_finds_what_a_page_would_get_wrong():
    text = "Try `sharktank run DIR --tokens 1,2 --no-such-flag`.\n```bash\n.venv/bin/sharktank export --model m \\\n    --tpp 2 && sharktank inspect out --json\n```\n"
    assert shown_commands(text) == [("export", ["--model", "--tpp"]), ("inspect", ["--json"]), ("run", ["--tokens", "--no-such-flag"])]
    commands = subcommands()
    assert "--no-such-flag" not in commands["run"] and "--tpp" not in commands["export"]
