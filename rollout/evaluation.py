"""Setting a task up before the agent runs (its sandbox, files and commands), and judging the
sandbox after it stops.

Both run through the SDK's AsyncSandbox, so the daemon's pipeline and the trainer adapters (which
hold their own sandboxes) share one implementation.

What counts as infrastructure rather than the agent's doing: a setup step that fails (the agent has
not run yet); eval files that cannot be written; the sandbox or the daemon failing under the
evaluation (a CorralError). Once the agent has run, what the evaluation commands do is the agent's
doing: a test that fails, a command that crashes or exits non-zero, a reward rule with nothing to
read (no number printed, no report written) are reward 0, never a filter the agent could reach for
to dodge a 0. An evaluation that runs past its time is a stage timeout, decided by the pipeline.

The evaluation does not trust the sandbox the agent leaves (docs/rollouts.md, "Evaluation the agent
cannot influence"). By default it does not run there at all: clean_eval.py takes the agent's change
(change.py) to a clean sandbox of the task and `evaluate` applies it there first. In the agent's
own sandbox (a task's IN_PLACE opt-in) every process the agent left is killed first. Either way
whatever sits where evaluation files and reports go is removed; commands run with a fresh HOME and
an environment that turns off Python's user site and git's repository hooks; and what the
commands leave running is killed before the reward is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import re
import secrets
import shlex
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable
from dataclasses import dataclass

from corral.sdk import AsyncClient, AsyncSandbox, CorralError, ExecResult, InvalidArgument, NotFound
from corral.v1 import rollout_pb2 as pb
from corral.v1 import sandbox_pb2

from .change import Change, ChangeSpec, apply_change
from .observations import observations_reward

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


class NoVerdict(Exception):
    """The reward rule found nothing to judge (no number, no report): reward 0, the agent's doing."""


@dataclass(frozen=True)
class Evaluation:
    reward: float
    # The evaluation commands' output, capped, for people reading results.
    output: bytes


async def create_task_sandbox(client: AsyncClient, task: pb.Task, *, rollout_id: str) -> AsyncSandbox:
    """Creates the sandbox a task names (backend, image, resources, user), labelled with the rollout and
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
            user=task.user or None,
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


# The environment evaluation commands add to the sandbox's: a HOME the agent never saw (no rc
# files, no ~/.local user site, no ~/.gitconfig), Python's user site off, and git run without the
# repository's hooks and fsmonitor (command-line settings outrank the repository's .git/config).
EVAL_ENV = {
    "PYTHONNOUSERSITE": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.hooksPath",
    "GIT_CONFIG_VALUE_0": "/dev/null",
    "GIT_CONFIG_KEY_1": "core.fsmonitor",
    "GIT_CONFIG_VALUE_1": "false",
}
# Kills every process the sandbox's user can signal (kill(-1) spares the caller and the sandbox's
# init): what the agent started in the background cannot touch the evaluation.
STOP_AGENT_PROCESSES = "kill -9 -1 2>/dev/null"


def _stop_script(sandbox: AsyncSandbox) -> str:
    """STOP_AGENT_PROCESSES where the sandbox has processes of its own. Without isolation its
    commands are host processes of a host user, whom kill(-1) would hit everywhere: nothing is
    stopped there (such sandboxes are not for untrusted agents; docs/rollouts.md)."""
    return ":" if sandbox.info.isolation == "none" else STOP_AGENT_PROCESSES


def _clear_path_script(path: str) -> str:
    """Shell that removes `path` (relative to the workdir unless absolute), the __pycache__ next to
    it, and any ancestor that is a symlink or not a directory, so a file written there afterwards
    lands where its path says and nothing the agent prepared is found beside it."""
    parts = [part for part in path.split("/") if part and part != "."]
    prefix = "/" if path.startswith("/") else ""
    lines = []
    for depth in range(1, len(parts)):
        ancestor = shlex.quote(prefix + "/".join(parts[:depth]))
        lines.append(
            f"if [ -L {ancestor} ] || {{ [ -e {ancestor} ] && [ ! -d {ancestor} ]; }}; then rm -rf -- {ancestor}; fi"
        )
    parent = prefix + "/".join(parts[:-1])
    pycache = posixpath.join(parent, "__pycache__") if parent else "__pycache__"
    lines.append(f"rm -rf -- {shlex.quote(prefix + '/'.join(parts))} {shlex.quote(pycache)}")
    return "\n".join(lines)


def _reward_files(evaluation: pb.TaskEvaluation) -> list[str]:
    """Files the reward rule reads, which only the evaluation itself may write."""
    if evaluation.WhichOneof("reward") == "junit":
        return [evaluation.junit.report_path]
    return []


async def _prepare(
    sandbox: AsyncSandbox, evaluation: pb.TaskEvaluation, home: str, timeout_s: float, *, stop: bool
) -> None:
    """Stops the agent's processes (when `stop`), clears where the evaluation files and reports go,
    and makes the evaluation's HOME. Raises EvaluationInfraError."""
    paths = [file.path for file in evaluation.files] + _reward_files(evaluation)
    script = "\n".join(
        [
            _stop_script(sandbox) if stop else ":",
            *(_clear_path_script(path) for path in paths),
            f"mkdir -m 700 {shlex.quote(home)}",
        ]
    )
    result = await sandbox.exec(script, timeout=timeout_s)
    if not result.ok:
        raise EvaluationInfraError(f"preparing the evaluation {_describe(result)}: {_tail(result)}")


async def evaluate(
    sandbox: AsyncSandbox,
    evaluation: pb.TaskEvaluation,
    *,
    command_timeout_s: float,
    change: Change | None = None,
    spec: ChangeSpec | None = None,
    note: str = "",
) -> Evaluation:
    """Runs the evaluation in `sandbox`: the agent's own (in place: what it left running is
    stopped first), or, with `change`, a clean sandbox the change is applied to first (its paths
    as `spec` names them in that sandbox). Then the
    evaluation files are copied in, the commands run and the reward rule is applied. A task without
    evaluation commands gets reward 0. `note` opens the output. Raises EvaluationInfraError."""
    if not evaluation.commands:
        return Evaluation(0.0, b"")
    output = bytearray(f"[corral] {note}\n".encode() if note else b"")
    if change is not None:
        assert spec is not None
        try:
            await apply_change(sandbox, change, spec, timeout_s=command_timeout_s)
        except CorralError as error:
            raise EvaluationInfraError(f"applying the agent's change to the clean sandbox failed: {error}") from error
        output += f"[corral] the agent's change: {change.summary(spec)}\n".encode()
    home = f"/tmp/.corral-eval-{secrets.token_hex(8)}"
    await _prepare(sandbox, evaluation, home, command_timeout_s, stop=change is None)
    try:
        await place_files(sandbox, evaluation.files)
    except CorralError as error:
        raise EvaluationInfraError(f"copying the evaluation files failed: {error}") from error
    env = {**EVAL_ENV, "HOME": home}
    result: ExecResult | None = None
    failure: str | None = None
    for position, command in enumerate(evaluation.commands):
        result = await sandbox.exec(command, env=env, timeout=command_timeout_s, output_limit=EVAL_OUTPUT_LIMIT)
        output += f"$ {command}\n".encode() + result.stdout + result.stderr
        if result.timed_out:
            raise EvaluationInfraError(f"evaluation command {command!r} ran past {command_timeout_s:g} s")
        is_last = position == len(evaluation.commands) - 1
        if result.signal or (not is_last and not result.ok):
            failure = f"evaluation command {command!r} {_describe(result)}"
            break
    assert result is not None
    # Anything the commands started in the background stops before the reward is read.
    await sandbox.exec(_stop_script(sandbox), timeout=command_timeout_s)
    try:
        reward = 0.0 if failure else await _reward(sandbox, evaluation, result)
    except NoVerdict as error:
        failure = str(error)
        reward = 0.0
    if failure:
        output += f"[corral] reward 0: {failure}\n".encode()
    return Evaluation(reward, bytes(output[-EVAL_OUTPUT_LIMIT:]))


async def _reward(sandbox: AsyncSandbox, evaluation: pb.TaskEvaluation, last: ExecResult) -> float:
    rule = evaluation.WhichOneof("reward")
    if rule == "printed_number":
        return printed_number_reward(last.stdout)
    if rule == "junit":
        try:
            report = await sandbox.read_file(evaluation.junit.report_path)
        except NotFound as error:
            raise NoVerdict(f"no JUnit report at {evaluation.junit.report_path}: {error}") from error
        return junit_reward(report, evaluation.junit.tests, all_must_pass=evaluation.junit.all_must_pass)
    if rule == "expected_observations":
        rule_pb = evaluation.expected_observations
        try:
            return observations_reward(last.stdout, rule_pb.expected, partial_credit=rule_pb.partial_credit)
        except ValueError as error:
            raise EvaluationInfraError(f"the reward rule cannot be applied: {error}") from error
    return 1.0 if last.exit_code == 0 else 0.0


def printed_number_reward(stdout: bytes) -> float:
    """The last number the command printed."""
    numbers = _NUMBER.findall(stdout.decode(errors="replace"))
    if not numbers:
        raise NoVerdict("the evaluation command printed no number")
    return float(numbers[-1])


def junit_reward(report: bytes, tests: Iterable[str], *, all_must_pass: bool = False) -> float:
    """The fraction of `tests` (pytest ids) that passed in a JUnit XML report; all tests in the
    report when `tests` is empty. A named test absent from the report counts as failed. With
    `all_must_pass`, 1.0 when every one passed, else 0.0."""
    outcomes = junit_outcomes(report)
    wanted = list(tests) or list(outcomes)
    if not wanted:
        raise NoVerdict("the JUnit report has no tests")
    passed = sum(outcomes.get(test_id, False) for test_id in wanted)
    if all_must_pass:
        return 1.0 if passed == len(wanted) else 0.0
    return passed / len(wanted)


def junit_outcomes(report: bytes) -> dict[str, bool]:
    """pytest test id → passed, from pytest's JUnit XML (classname "tests.test_x.TestC", name
    "test_y[param]" → "tests/test_x.py::TestC::test_y[param]")."""
    try:
        root = ElementTree.fromstring(report)
    except ElementTree.ParseError as error:
        raise NoVerdict(f"the JUnit report is not valid XML: {error}") from None
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
