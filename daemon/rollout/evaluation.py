"""Setting a task up before the agent runs, and judging the sandbox after it stops.

Both run through the SDK's AsyncSandbox, so the daemon's pipeline and the trainer adapters (which
hold their own sandboxes) share one implementation.

What counts as infrastructure rather than the agent's doing: a setup step that fails (the agent has
not run yet); eval files that cannot be written; an evaluation command killed by a signal (a crash:
the command itself is broken); a reward rule that cannot be applied (no number printed, no JUnit
report). A test that fails, even because the agent broke the code, is reward 0, not infrastructure.
An evaluation command that runs past its time is a stage timeout, decided by the pipeline.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable
from dataclasses import dataclass

from corral.sdk import AsyncSandbox, CorralError, ExecResult
from corral.v1 import rollout_pb2 as pb

EVAL_OUTPUT_LIMIT = 64 * 1024
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


class SetupFailed(Exception):
    """The task could not be set up (filtered as SANDBOX_START)."""


class EvaluationInfraError(Exception):
    """The evaluation could not be carried out (filtered as EVAL_INFRA)."""


@dataclass(frozen=True)
class Evaluation:
    reward: float
    # The evaluation commands' output, capped, for people reading results.
    output: bytes


async def place_files(sandbox: AsyncSandbox, files: Iterable[pb.TaskFile]) -> None:
    for file in files:
        await sandbox.write_file(file.path, file.content, mode=file.mode or None)


async def set_up(sandbox: AsyncSandbox, setup: pb.TaskSetup, *, action_timeout_s: float) -> None:
    """Places the task's files and runs its setup commands. Raises SetupFailed."""
    try:
        await place_files(sandbox, setup.files)
    except CorralError as error:
        raise SetupFailed(f"placing the setup files failed: {error}") from error
    for command in setup.commands:
        result = await sandbox.exec(command, timeout=action_timeout_s)
        if not result.ok:
            raise SetupFailed(f"setup command {command!r} {_describe(result)}: {_tail(result)}")


async def evaluate(sandbox: AsyncSandbox, evaluation: pb.TaskEvaluation, *, command_timeout_s: float) -> Evaluation:
    """Copies the evaluation files in, runs the commands and applies the reward rule. A task
    without evaluation commands gets reward 0. Raises EvaluationInfraError."""
    if not evaluation.commands:
        return Evaluation(0.0, b"")
    try:
        await place_files(sandbox, evaluation.files)
    except CorralError as error:
        raise EvaluationInfraError(f"copying the evaluation files failed: {error}") from error
    output = bytearray()
    result: ExecResult | None = None
    for position, command in enumerate(evaluation.commands):
        result = await sandbox.exec(command, timeout=command_timeout_s, output_limit=EVAL_OUTPUT_LIMIT)
        output += f"$ {command}\n".encode() + result.stdout + result.stderr
        if result.timed_out:
            raise EvaluationInfraError(f"evaluation command {command!r} ran past {command_timeout_s:g} s")
        if result.signal:
            raise EvaluationInfraError(f"evaluation command {command!r} crashed ({_describe(result)})")
        is_last = position == len(evaluation.commands) - 1
        if not is_last and not result.ok:
            raise EvaluationInfraError(f"evaluation command {command!r} {_describe(result)}: {_tail(result)}")
    assert result is not None
    reward = await _reward(sandbox, evaluation, result)
    return Evaluation(reward, bytes(output[-EVAL_OUTPUT_LIMIT:]))


async def _reward(sandbox: AsyncSandbox, evaluation: pb.TaskEvaluation, last: ExecResult) -> float:
    rule = evaluation.WhichOneof("reward")
    if rule == "printed_number":
        return printed_number_reward(last.stdout)
    if rule == "junit":
        try:
            report = await sandbox.read_file(evaluation.junit.report_path)
        except CorralError as error:
            raise EvaluationInfraError(f"no JUnit report at {evaluation.junit.report_path}: {error}") from error
        return junit_reward(report, evaluation.junit.tests)
    return 1.0 if last.exit_code == 0 else 0.0


def printed_number_reward(stdout: bytes) -> float:
    """The last number the command printed."""
    numbers = _NUMBER.findall(stdout.decode(errors="replace"))
    if not numbers:
        raise EvaluationInfraError("the evaluation command printed no number")
    return float(numbers[-1])


def junit_reward(report: bytes, tests: Iterable[str]) -> float:
    """The fraction of `tests` (pytest ids) that passed in a JUnit XML report; all tests in the
    report when `tests` is empty. A named test absent from the report counts as failed."""
    outcomes = junit_outcomes(report)
    wanted = list(tests) or list(outcomes)
    if not wanted:
        raise EvaluationInfraError("the JUnit report has no tests")
    return sum(outcomes.get(test_id, False) for test_id in wanted) / len(wanted)


def junit_outcomes(report: bytes) -> dict[str, bool]:
    """pytest test id → passed, from pytest's JUnit XML (classname "tests.test_x.TestC", name
    "test_y[param]" → "tests/test_x.py::TestC::test_y[param]")."""
    try:
        root = ElementTree.fromstring(report)
    except ElementTree.ParseError as error:
        raise EvaluationInfraError(f"the JUnit report is not valid XML: {error}") from None
    outcomes: dict[str, bool] = {}
    for case in root.iter("testcase"):
        failed = any(case.find(tag) is not None for tag in ("failure", "error", "skipped"))
        outcomes[_pytest_id(case.get("classname", ""), case.get("name", ""))] = not failed
    return outcomes


def _pytest_id(classname: str, name: str) -> str:
    # pytest writes the module path with dots; class names start with an upper-case letter.
    parts = classname.split(".") if classname else []
    classes: list[str] = []
    while parts and parts[-1][:1].isupper():
        classes.insert(0, parts.pop())
    module = "/".join(parts) + ".py" if parts else ""
    return "::".join(part for part in (module, *classes, name) if part)


def _describe(result: ExecResult) -> str:
    if result.timed_out:
        return "timed out"
    if result.signal:
        return f"was killed by signal {result.signal}"
    return f"exited {result.exit_code}"


def _tail(result: ExecResult, limit: int = 400) -> str:
    text = (result.stderr or result.stdout).decode(errors="replace").strip()
    return text[-limit:]
