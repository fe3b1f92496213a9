#!/usr/bin/env python3
"""The table of behaviours tested per backend, from the suite's test ids (tests/README.md, "No lost
coverage"): one row per test function, one column per backend case, the number of cases of that
function on that backend in each cell.

    scripts/backend_coverage.py                      collect now (pytest --collect-only) and print the table
    scripts/backend_coverage.py --ids FILE           read test ids (one per line) instead
    scripts/backend_coverage.py --modules            one row per test module
    scripts/backend_coverage.py --ids NEW --before OLD
                                                     print what changed: functions that lost or gained
                                                     a backend, and those that left or joined the suite

A case is read from a test id's parameters: a conformance case (local-bwrap, local-unshare, docker,
podman, singularity) or a backend name alone ("local", "docker", "podman", "singularity"). Tests
without one are listed under "-".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("local-bwrap", "local-unshare", "docker", "podman", "singularity")
# A parameter naming a backend alone counts for its default case (local: bubblewrap).
BACKEND_ALIASES = {"local": ("local-bwrap",), "apptainer": ("singularity",)}
NONE = "-"


def collect() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def cases_of(test_id: str) -> tuple[str, ...]:
    if "[" not in test_id:
        return (NONE,)
    params = test_id.split("[", 1)[1].rstrip("]")
    found = [case for case in CASES if _names(params, case)]
    if not found:
        for alias, aliased in BACKEND_ALIASES.items():
            if _names(params, alias):
                found += aliased
    return tuple(found) or (NONE,)


def _names(params: str, name: str) -> bool:
    """Whether `name` is one of the dash-joined parameter ids (local-bwrap is one, two dashes or not)."""
    return params == name or params.startswith(f"{name}-") or params.endswith(f"-{name}") or f"-{name}-" in params


def table(ids: list[str]) -> dict[str, dict[str, int]]:
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for test_id in ids:
        function = test_id.split("[", 1)[0]
        for case in cases_of(test_id):
            rows[function][case] += 1
    return rows


def markdown(rows: dict[str, dict[str, int]]) -> str:
    columns = [*CASES, NONE]
    lines = ["| test | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for function in sorted(rows):
        cells = [str(rows[function].get(c, "")) for c in columns]
        lines.append(f"| {function} | " + " | ".join(cells) + " |")
    totals = [str(sum(r.get(c, 0) for r in rows.values())) for c in columns]
    lines.append("| **cases** | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def by_module(rows: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The table summed per test module: cases per backend case."""
    modules: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for function, cases in rows.items():
        for case, count in cases.items():
            modules[function.split("::", 1)[0]][case] += count
    return modules


def changes(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> str:
    lines = []
    for function in sorted(set(before) | set(after)):
        old, new = set(before.get(function, {})), set(after.get(function, {}))
        if function not in after:
            lines.append(f"left the suite (moved or renamed): {function} [{', '.join(sorted(old))}]")
        elif function not in before:
            lines.append(f"new: {function} [{', '.join(sorted(new))}]")
        elif old != new:
            lost, gained = sorted(old - new), sorted(new - old)
            lines.append(
                f"{function}: "
                + "; ".join(p for p in (f"lost {lost}" if lost else "", f"gained {gained}" if gained else "") if p)
            )
    return "\n".join(lines) or "no change"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=Path, help="test ids, one per line (default: collect them now)")
    parser.add_argument("--before", type=Path, help="the test ids of an earlier tree, to compare with")
    parser.add_argument("--modules", action="store_true", help="one row per test module instead of per function")
    args = parser.parse_args(argv)
    ids = [line.strip() for line in args.ids.read_text().splitlines() if "::" in line] if args.ids else collect()
    if args.before:
        old = [line.strip() for line in args.before.read_text().splitlines() if "::" in line]
        print(changes(table(old), table(ids)))
    else:
        rows = table(ids)
        print(markdown(by_module(rows) if args.modules else rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
