"""Sealed evaluation: tests that observe values in the sandbox and are judged outside it.

A test that asserts inside the sandbox runs its comparisons in the same process as the agent's code,
which can replace them (`TestCase.assertEqual = lambda *a: None`), return objects equal to anything,
exit 0 before a test runs, or read the expected values from the test file. Sealing moves the
comparison out: `seal_unittest_source` rewrites a unittest file so that each assertion *prints* its
observed value instead of comparing it (the expected operand is dropped from the file), the
evaluation runs the rewritten tests with `OBSERVATION_RUNNER`, and `observations_reward` compares the
printed values with expected values the daemon keeps and the sandbox never sees. The expected values
come from running the sealed tests against a reference solution (`read_observations`).

What it cannot stop: an agent that prints the right values has computed them. Observations whose
value is guessable without solving (a boolean from assertTrue, "raised" from assertRaises) can be
printed by planted code; in an all-or-nothing task that earns nothing unless every other
observation is right too.
"""

from __future__ import annotations

import ast
import datetime
import decimal
import fractions
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

# The script that runs sealed tests in the sandbox (standard library only): copy it next to them.
OBSERVATION_RUNNER = Path(__file__).with_name("observation_runner.py")
RUNNER_NAME = "run_observations.py"
_MISSING = object()


class SealError(ValueError):
    """A test file uses an assertion sealing cannot rewrite, or its observations are not literals."""


# assertX(a, b, ...) → the value observed (an expression of the arguments; never the expected operand
# alone, so the file does not hold the answer).
def _observed(method: str, args: list[ast.expr]) -> ast.expr | None:
    def call(name: str, *values: ast.expr) -> ast.expr:
        return ast.Call(func=ast.Name(name, ast.Load()), args=list(values), keywords=[])

    def compare(op: ast.cmpop) -> ast.expr:
        return ast.Compare(left=args[0], ops=[op], comparators=[args[1]])

    rules = {
        "assertEqual": lambda: args[0],
        "assertTrue": lambda: call("bool", args[0]),
        "assertFalse": lambda: call("bool", args[0]),
        "assertIsNone": lambda: ast.Compare(args[0], [ast.Is()], [ast.Constant(None)]),
        "assertIsNotNone": lambda: ast.Compare(args[0], [ast.IsNot()], [ast.Constant(None)]),
        "assertIn": lambda: compare(ast.In()),
        "assertNotIn": lambda: compare(ast.NotIn()),
        "assertIsInstance": lambda: call("isinstance", args[0], args[1]),
        "assertLess": lambda: compare(ast.Lt()),
        "assertLessEqual": lambda: compare(ast.LtE()),
        "assertGreater": lambda: compare(ast.Gt()),
        "assertGreaterEqual": lambda: compare(ast.GtE()),
        "assertAlmostEqual": lambda: call("round", args[0], ast.Constant(7)),
        "assertCountEqual": lambda: call("sorted", call("map", ast.Name("repr", ast.Load()), args[0])),
    }
    rule = rules.get(method)
    return None if rule is None else rule()


class _Sealer(ast.NodeTransformer):
    def __init__(self, filename: str) -> None:
        self.filename = filename

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        target = node.func
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
            return node
        method = target.attr
        if method == "assertRaises":
            if len(node.args) != 1 or node.keywords:
                raise SealError(f"{self.filename}:{node.lineno}: use assertRaises(Error) as a context manager")
            return ast.Call(ast.Attribute(target.value, "observe_raises", ast.Load()), node.args, [])
        if not method.startswith("assert"):
            return node
        observed = _observed(method, node.args)
        if observed is None:
            raise SealError(f"{self.filename}:{node.lineno}: sealing does not know {method}")
        return ast.Call(ast.Attribute(target.value, "observe", ast.Load()), [observed], [])


def seal_unittest_source(source: str, filename: str = "<test>") -> str:
    """The unittest file with each `self.assertX(...)` replaced by `self.observe(value)` and each
    `with self.assertRaises(E):` by `with self.observe_raises(E):` (run by OBSERVATION_RUNNER)."""
    tree = _Sealer(filename).visit(ast.parse(source, filename))
    header = '"""Sealed tests: each assertion prints what it observed; the daemon judges it."""\n'
    body = ast.unparse(ast.fix_missing_locations(tree))
    return header + body + "\n"


def read_observations(stdout: bytes) -> dict[str, list[str]]:
    """Key → every value printed for it: the lines "<nonce> <key>\\t<literal>" that carry the nonce
    of the first "corral-observations <nonce>" line (the runner's); other lines are ignored."""
    printed: dict[str, list[str]] = defaultdict(list)
    prefix: str | None = None
    for line in stdout.decode("utf-8", errors="replace").splitlines():
        if prefix is None:
            header, _, nonce = line.partition(" ")
            if header == "corral-observations" and nonce:
                prefix = nonce + " "
            continue
        if not line.startswith(prefix):
            continue
        key, tab, value = line[len(prefix) :].partition("\t")
        if tab and key:
            printed[key].append(value)
    return dict(printed)


# Values that are not Python literals but print as a call of their type: compared as that type.
_CONSTRUCTORS = {
    "datetime.date": datetime.date,
    "datetime.datetime": datetime.datetime,
    "datetime.time": datetime.time,
    "datetime.timedelta": datetime.timedelta,
    "datetime.timezone": datetime.timezone,
    "decimal.Decimal": decimal.Decimal,
    "Decimal": decimal.Decimal,
    "fractions.Fraction": fractions.Fraction,
    "set": set,
    "frozenset": frozenset,
    "Fraction": fractions.Fraction,
}


def _value(node: ast.expr) -> object:
    """A literal, or a call of a known type with literal arguments (never anything else)."""
    if isinstance(node, ast.Call) and not node.keywords:
        constructor = _CONSTRUCTORS.get(ast.unparse(node.func))
        if constructor is None:
            raise ValueError("not a known type")
        return constructor(*(_value(argument) for argument in node.args))
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_value(item) for item in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a dict")
        return {_value(key): _value(value) for key, value in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def _literal(text: str) -> object:
    try:
        return _value(ast.parse(text, mode="eval").body)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, ArithmeticError, decimal.InvalidOperation):
        return _MISSING


def observation_matches(printed: list[str] | None, expected: str) -> bool:
    """Printed exactly once and equal to the expected literal."""
    if printed is None or len(printed) != 1:
        return False
    value, wanted = _literal(printed[0]), _literal(expected)
    return value is not _MISSING and wanted is not _MISSING and bool(value == wanted)


def group_of(key: str) -> str:
    return key.rpartition("#")[0] or key


def observations_reward(stdout: bytes, expected: Mapping[str, str], *, partial_credit: bool) -> float:
    """The share of groups (tests) whose every observation matches; all-or-nothing unless
    `partial_credit`. No expected observations is an error of the task (ValueError)."""
    if not expected:
        raise ValueError("the task expects no observations")
    printed = read_observations(stdout)
    passed: dict[str, bool] = {}
    for key, value in expected.items():
        group = group_of(key)
        passed[group] = passed.get(group, True) and observation_matches(printed.get(key), value)
    share = sum(passed.values()) / len(passed)
    if partial_credit:
        return share
    return 1.0 if share == 1.0 else 0.0


def run_sealed(
    files: Mapping[str, bytes], runner_path: str, *, python: str = sys.executable
) -> subprocess.CompletedProcess:
    """Runs the runner at `runner_path` (isolated) in a scratch directory holding `files`, as the
    evaluation would in a sandbox: what a task's author runs on the reference solution to get the
    expected observations (the runner exits 1 when a test failed)."""
    with tempfile.TemporaryDirectory() as workdir:
        for path, content in files.items():
            target = Path(workdir, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        command = [python, "-I", runner_path]
        return subprocess.run(command, cwd=workdir, capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})


def expected_from(output: bytes) -> dict[str, str]:
    """The expected observations a passing run printed. SealError when one is not a literal."""
    expected = {}
    for key, values in sorted(read_observations(output).items()):
        if not observation_matches(values, values[0]):
            raise SealError(f"observation {key} is not one Python literal: {values!r}")
        expected[key] = values[0]
    return expected
