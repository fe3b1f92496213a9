"""A pytest plugin that writes where the suite's time goes: every test's setup, call and teardown
seconds from pytest's own reports, summed per test, per module and per backend case, as JSON
(tests/README.md, "The budget"). `scripts/test_durations.py` prints the heaviest modules from it
and checks the budget.

The file is `$CORRAL_TEST_DURATIONS`, else build/test-durations.json. Under pytest-xdist the
controller writes it (workers send their reports there), so it covers every worker; `wall_s` is
the controller's session time, `test_s` the sum over tests (more than `wall_s` when workers run
side by side).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

DEFAULT_PATH = Path("build/test-durations.json")
CASE_PROPERTY = "backend_case"
NO_CASE = "-"  # tests that do not take the conformance suite's `daemon`


def durations_path() -> Path:
    return Path(os.environ.get("CORRAL_TEST_DURATIONS") or DEFAULT_PATH)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Records in each item's reports the backend case it runs on (the conformance suite's
    `daemon` parameter, tests/conftest.py); user properties travel from xdist workers to the
    controller, which writes the file."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        case = callspec.params.get("daemon") if callspec is not None else None
        if isinstance(case, str):
            item.user_properties.append((CASE_PROPERTY, case))


class SuiteTiming:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.tests: dict[str, float] = defaultdict(float)
        self.cases: dict[str, str] = {}
        self.outcomes: dict[str, int] = defaultdict(int)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid] += report.duration
        for name, value in report.user_properties:
            if name == CASE_PROPERTY:
                self.cases[report.nodeid] = str(value)
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.outcome] += 1

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.tests:
            return
        modules: dict[str, float] = defaultdict(float)
        by_case: dict[str, float] = defaultdict(float)
        module_cases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for nodeid, seconds in self.tests.items():
            module = nodeid.split("::", 1)[0]
            case = self.cases.get(nodeid, NO_CASE)
            modules[module] += seconds
            by_case[case] += seconds
            module_cases[module][case] += seconds
        summary = {
            "wall_s": round(time.monotonic() - self.started, 3),
            "test_s": round(sum(self.tests.values()), 3),
            "workers": getattr(session.config.option, "numprocesses", None) or 1,  # (pytest-xdist's -n)
            "outcomes": dict(self.outcomes),
            "modules": _rounded(modules),
            "cases": _rounded(by_case),
            "module_cases": {m: _rounded(c) for m, c in sorted(module_cases.items())},
            "tests": _rounded(self.tests),
        }
        path = durations_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(path)


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sorted(values.items())}


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller gets its reports and writes the file
    config.pluginmanager.register(SuiteTiming(), "corral-suite-timing")
