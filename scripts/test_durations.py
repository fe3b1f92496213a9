#!/usr/bin/env python3
"""Prints where the test suite's time went, from the JSON that tests/timing.py writes, and checks
`make test` against its budget (tests/README.md, "The budget").

    scripts/test_durations.py [FILE]                      the table (default build/test-durations.json)
    scripts/test_durations.py FILE --elapsed S --check    also fail when S seconds exceed the budget
                                                          (--no-table: the verdict alone)

The budget lives in one place: `[tool.corral.tests] budget_minutes` in pyproject.toml.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVIEST = 20


def budget_minutes() -> float:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return float(tomllib.load(f)["tool"]["corral"]["tests"]["budget_minutes"])


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def _heaviest_first(seconds: dict[str, float]) -> dict[str, float]:
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def table(summary: dict) -> str:
    modules = _heaviest_first(summary["modules"])
    cases = _heaviest_first(summary["cases"])
    module_cases: dict[str, dict[str, float]] = summary["module_cases"]
    case_names = [c for c in cases if c != "-"]
    width = max((len(m) for m in list(modules)[:HEAVIEST]), default=10)
    lines = [f"the {min(HEAVIEST, len(modules))} heaviest test modules (seconds of setup + call + teardown):"]
    header = f"  {'module':<{width}} {'total':>8}" + "".join(f" {c:>13}" for c in case_names)
    lines.append(header)
    for module, seconds in list(modules.items())[:HEAVIEST]:
        row = f"  {module:<{width}} {seconds:8.1f}"
        for case in case_names:
            value = module_cases.get(module, {}).get(case)
            row += f" {value:13.1f}" if value else f" {'':>13}"
        lines.append(row)
    lines.append('per backend case ("-": tests without the conformance suite\'s daemon):')
    for case, seconds in cases.items():
        lines.append(f"  {case:<14} {seconds:8.1f} s")
    outcomes = ", ".join(f"{n} {o}" for o, n in sorted(summary.get("outcomes", {}).items()))
    lines.append(
        f"totals: {len(summary['tests'])} tests ({outcomes}) in {len(modules)} modules; "
        f"{_minutes(summary['test_s'])} of test time, {_minutes(summary['wall_s'])} of wall time "
        f"on {summary.get('workers', 1)} worker(s)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default="build/test-durations.json", type=Path)
    parser.add_argument("--elapsed", type=float, help="seconds `make test` took, to hold against the budget")
    parser.add_argument("--check", action="store_true", help="exit 1 when --elapsed exceeds the budget")
    parser.add_argument("--no-table", action="store_true", help="only the budget's verdict")
    args = parser.parse_args(argv)
    if not args.file.exists():
        print(f"no test durations at {args.file} (tests/timing.py writes them when pytest runs)", file=sys.stderr)
        return 1
    if not args.no_table:
        print(table(json.loads(args.file.read_text())))
    if args.elapsed is None:
        return 0
    budget_s = budget_minutes() * 60
    verdict = "within" if args.elapsed <= budget_s else "OVER"
    print(
        f"make test took {_minutes(args.elapsed)}: {verdict} its budget of {_minutes(budget_s)} (pyproject.toml, [tool.corral.tests])"
    )
    if args.check and args.elapsed > budget_s:
        print(
            "the suite is over its budget: see the heaviest modules above, and tests/README.md for where a test "
            "belongs (unit tier, one backend, every backend)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
