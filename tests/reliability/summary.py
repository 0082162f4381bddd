"""The "reliability figures" terminal section: fuzz counts, RSS, kill outcomes and (with -v) the
table of bad inputs, gathered from the tests' ``reliability:*`` user properties, which travel
back from xdist workers.

Only plugins loaded in the controlling process can print it. ``pytest tests/reliability``
loads tests/reliability/conftest.py there (it imports this hook); a run of the whole suite
loads only tests/conftest.py, which must import it too to show the section.
"""

from __future__ import annotations

__all__ = ["pytest_terminal_summary"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "_reliability_figures_shown", False):  # imported by two conftests
        return
    config._reliability_figures_shown = True
    lines, table, totals = [], [], {}
    for rep in terminalreporter.stats.get("passed", []):
        for key, value in getattr(rep, "user_properties", []):
            if not str(key).startswith("reliability:"):
                continue
            key = key.removeprefix("reliability:")
            if key == "bad input":
                table.append(value)
            elif isinstance(value, dict):  # counts from several tests: summed
                for k, v in value.items():
                    totals.setdefault(key, {}).setdefault(k, 0)
                    totals[key][k] += v
            else:
                lines.append(f"{key}: {value}")
    lines += [f"{key}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) for key, counts in totals.items()]
    if not lines and not table:
        return
    terminalreporter.section("reliability figures")
    for line in sorted(lines):
        terminalreporter.write_line(line)
    if table:
        terminalreporter.write_line(f"bad-input cases: {len(table)} (-v lists each with the error it got)")
        if config.getoption("verbose") > 0:
            for row in sorted(table):
                terminalreporter.write_line(f"  {row}")
