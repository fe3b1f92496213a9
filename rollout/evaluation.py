"""Setting a task up before the agent runs (its sandbox, files and commands), and judging the
sandbox after it stops.

Both run through the SDK's AsyncSandbox, so the daemon's pipeline and the trainer adapters (which
hold their own sandboxes) share one implementation.

What counts as infrastructure rather than the agent's doing: a setup step that fails (the agent has
not run yet); eval files that cannot be written; an evaluation command killed by a signal (a crash:
the command itself is broken); a reward rule that cannot be applied (no number printed, no JUnit
report). A test that fails, even because the agent broke the code, is reward 0, not infrastructure.
An evaluation command that runs past its time is a stage timeout, decided by the pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable
from dataclasses import dataclass

from corral.sdk import AsyncClient, AsyncSandbox, CorralError, ExecResult, InvalidArgument, NotFound
from corral.v1 import rollout_pb2 as pb
from corral.v1 import sandbox_pb2

EVAL_OUTPUT_LIMIT = 64 * 1024
# How long a creation that was cancelled midway may take to finish, so its sandbox can be removed.
CANCELLED_CREATE_TIMEOUT_S = 60.0
# Pause before retrying a sandbox start that failed for infrastructure reasons (doubling each time):
# the failures worth retrying (a node at its limit, an engine restarting) take a moment to clear.
INIT_RETRY_BACKOFF_S = 0.5
INIT_RETRY_MAX_BACKOFF_S = 8.0
ROLLOUT_LABEL = "io.corral.rollout"
TASK_LABEL = "io.corral.task"
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


_log = logging.getLogger(__name__)


class SetupFailed(Exception):
    """The task could not be set up (filtered as SANDBOX_START)."""


class SandboxStartFailed(Exception):
    """The task's sandbox could not be created or set up, retries included (SANDBOX_START)."""


class EvaluationInfraError(Exception):
    """The evaluation could not be carried out (filtered as EVAL_INFRA)."""


@dataclass(frozen=True)
class Evaluation:
    reward: float
    # The evaluation commands' output, capped, for people reading results.
    output: bytes


async def create_task_sandbox(client: AsyncClient, task: pb.Task, *, rollout_id: str) -> AsyncSandbox:
    """Creates the sandbox a task names (backend, image, resources), labelled with the rollout and
    task ids. Cancelled midway, it lets the creation finish and destroys the sandbox before the
    cancellation goes on, so nothing is left half-made."""
    backend = (
        None
        if task.backend == sandbox_pb2.BACKEND_UNSPECIFIED
        else sandbox_pb2.Backend.Name(task.backend).removeprefix("BACKEND_").lower()
    )
    creating = asyncio.ensure_future(
        client.create_sandbox(
            image=task.image or None,
            backend=backend,
            memory_bytes=task.resources.memory_bytes or None,
            pids=task.resources.pids or None,
            cpu_millicores=task.resources.cpu_millicores or None,
            labels={ROLLOUT_LABEL: rollout_id, TASK_LABEL: task.task_id},
        )
    )
    try:
        return await asyncio.shield(creating)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            sandbox = await asyncio.wait_for(creating, CANCELLED_CREATE_TIMEOUT_S)
            await asyncio.wait_for(sandbox.destroy(), CANCELLED_CREATE_TIMEOUT_S)
        raise


async def start_task_sandbox(
    client: AsyncClient, task: pb.Task, *, rollout_id: str, retries: int, action_timeout_s: float
) -> AsyncSandbox:
    """Creates the task's sandbox and sets the task up in it. A failure of the node (a CorralError
    other than a bad image or request) is retried `retries` times with a doubling pause; a bad
    image, a bad request or a failing setup step is not. Raises SandboxStartFailed; whatever ends
    it early (failure, cancellation, a caller's timeout), no sandbox is left behind."""
    attempts = retries + 1
    for attempt in range(1, attempts + 1):
        sandbox: AsyncSandbox | None = None
        try:
            sandbox = await create_task_sandbox(client, task, rollout_id=rollout_id)
            await set_up(sandbox, task.setup, action_timeout_s=action_timeout_s)
            return sandbox
        except BaseException as error:
            if sandbox is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sandbox.destroy(), CANCELLED_CREATE_TIMEOUT_S)
            if isinstance(error, (NotFound, InvalidArgument)):
                raise SandboxStartFailed(f"creating the sandbox failed: {error}") from error
            if isinstance(error, SetupFailed):
                raise SandboxStartFailed(str(error)) from error
            if not isinstance(error, CorralError):
                raise
            if attempt == attempts:
                raise SandboxStartFailed(f"creating the sandbox failed {attempts} times: {error}") from error
            _log.warning("%s: sandbox start failed (attempt %d of %d): %s", rollout_id, attempt, attempts, error)
        await asyncio.sleep(min(INIT_RETRY_BACKOFF_S * 2 ** (attempt - 1), INIT_RETRY_MAX_BACKOFF_S))
    raise AssertionError("unreachable")


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
