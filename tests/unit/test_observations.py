"""Sealed evaluation (corral.rollout.observations): rewriting unittest files, running them with the
runner, and judging the printed observations against expected values kept outside."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from corral.rollout.observations import (
    OBSERVATION_RUNNER,
    RUNNER_NAME,
    SealError,
    observations_reward,
    read_observations,
    seal_unittest_source,
)

TESTS = """
import unittest
from lib import total, parse

class LibTest(unittest.TestCase):
    def test_total(self):
        self.assertEqual(total([1, 2]), 3)
        self.assertTrue(total([]) == 0)

    def test_parse_rejects(self):
        with self.assertRaises(ValueError) as caught:
            parse("x")
        self.assertIn("x", str(caught.exception))
"""


def _run(tmp_path: Path, lib: str) -> bytes:
    (tmp_path / "lib.py").write_text(lib)
    hidden = tmp_path / "tests_hidden"
    hidden.mkdir(exist_ok=True)
    (hidden / "__init__.py").write_text("")
    (hidden / "test_lib.py").write_text(seal_unittest_source(TESTS))
    (hidden / RUNNER_NAME).write_bytes(OBSERVATION_RUNNER.read_bytes())
    command = [sys.executable, "-I", f"tests_hidden/{RUNNER_NAME}"]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=60).stdout


GOOD = "def total(xs):\n    return sum(xs)\n\ndef parse(s):\n    raise ValueError('bad: ' + s)\n"


def test_sealing_drops_expected_operands_and_keeps_the_observed_values() -> None:
    sealed = seal_unittest_source(TESTS)
    assert "self.assert" not in sealed
    assert "self.observe(total([1, 2]))" in sealed and ", 3)" not in sealed
    assert "with self.observe_raises(ValueError) as caught:" in sealed
    with pytest.raises(SealError, match="assertWarns"):
        seal_unittest_source("class T:\n    def test(self):\n        self.assertWarns(Warning)\n")


def test_a_correct_solution_matches_and_wrong_or_forged_ones_do_not(tmp_path: Path) -> None:
    expected = {key: values[0] for key, values in read_observations(_run(tmp_path, GOOD)).items()}
    assert expected["tests_hidden.test_lib.LibTest.test_total#1"] == "3"
    assert expected["tests_hidden.test_lib.LibTest.test_parse_rejects#1"] == "'raised'"
    assert len(expected) == 6  # 2 + 2 observations, and each test's end
    # Equal as Python values counts (3.0 == 3), even with another repr.
    assert (
        observations_reward(_run(tmp_path, GOOD.replace("sum(xs)", "float(sum(xs))")), expected, partial_credit=False)
        == 1.0
    )
    wrong = GOOD.replace("sum(xs)", "len(xs)")
    assert observations_reward(_run(tmp_path, wrong), expected, partial_credit=False) == 0.0
    assert observations_reward(_run(tmp_path, wrong), expected, partial_credit=True) == 0.5
    # Code under test that prints observation lines itself, or exits before the tests, gets nothing.
    forged = "\n".join("print(" + repr(key + "\t" + value) + ")" for key, value in expected.items())
    assert (
        observations_reward(_run(tmp_path, forged + "\nimport os\nos._exit(0)\n"), expected, partial_credit=True) == 0.0
    )
    # An object equal to everything does not print as the expected literal.
    always_equal = (
        "class Any:\n    __eq__ = lambda self, other: True\n\ndef total(xs):\n    return Any()\n"
        + GOOD.split("\n\n")[1]
    )
    assert observations_reward(_run(tmp_path, always_equal), expected, partial_credit=True) == 0.5


def test_reading_takes_only_lines_with_the_first_token_and_a_repeated_key_fails() -> None:
    stdout = b"noise\ncorral-observations abc\nabc k#1\t1\nxyz k#1\t1\nk#2\t2\ncorral-observations xyz\nabc k#2\t2\n"
    assert read_observations(stdout) == {"k#1": ["1"], "k#2": ["2"]}
    assert observations_reward(stdout, {"k#1": "1", "k#2": "2"}, partial_credit=False) == 1.0
    twice = stdout + b"abc k#1\t1\n"
    assert observations_reward(twice, {"k#1": "1", "k#2": "2"}, partial_credit=False) == 0.0
    assert observations_reward(b"k#1\t1\n", {"k#1": "1"}, partial_credit=True) == 0.0  # no token line


@pytest.mark.parametrize(
    ("printed", "expected", "matches"),
    [
        ("{1, 2}", "{2, 1}", True),
        ("datetime.date(2024, 3, 5)", "datetime.date(2024, 3, 5)", True),
        ("Decimal('1.10')", "Decimal('1.1')", True),
        ("set()", "set()", True),
        ("<object at 0x1>", "<object at 0x1>", False),  # not a literal: never matches
        ("__import__('os').system('true')", "0", False),
        ("[1, 2]", "(1, 2)", False),
    ],
)
def test_values_compare_as_python_literals(printed: str, expected: str, matches: bool) -> None:
    stdout = f"corral-observations n\nn t#1\t{printed}\n".encode()
    assert observations_reward(stdout, {"t#1": expected}, partial_credit=False) == float(matches)
