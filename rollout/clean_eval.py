"""Clean evaluation: the evaluation runs in a sandbox of the task's clean INIT state with only the
agent's change applied (docs/rollouts.md, "Evaluation the agent cannot influence").

At INIT, once the setup is done and before the agent runs, the set-up sandbox is recorded: a
manifest of the change's trees (change.py) and, where the backend can fork, a named snapshot.
At EVAL the agent's change is read from its sandbox against the manifest, the agent's sandbox is
destroyed, and the clean sandbox is a fork of the snapshot (or, where there is none, a new
sandbox of the task, set up again); the change is applied there, then the evaluation files, then
the commands run. The pipeline and the tunix adapter share these pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from corral.rollout.change import (
    ChangeTooLarge,
    ChangeUnreadable,
    Manifest,
    capture_change,
    change_spec,
    spec_key,
    take_manifest,
)
from corral.rollout.evaluation import (
    CANCELLED_CREATE_TIMEOUT_S,
    INIT_RETRY_BACKOFF_S,
    INIT_RETRY_MAX_BACKOFF_S,
    ROLLOUT_LABEL,
    TASK_LABEL,
    Evaluation,
    EvaluationInfraError,
    SandboxStartFailed,
    evaluate,
    start_task_sandbox,
)
from corral.sdk import AsyncClient, AsyncSandbox, CorralError, FailedPrecondition, NotFound
from corral.v1 import rollout_pb2 as pb

_log = logging.getLogger(__name__)


def evaluates_in_place(task: pb.Task) -> bool:
    """Whether the task's evaluation runs in the agent's own sandbox (the IN_PLACE opt-in), or
    needs none (no commands: reward 0)."""
    evaluation = task.evaluation
    return evaluation.isolation == pb.EVALUATION_ISOLATION_IN_PLACE or not evaluation.commands


class CleanBaseFailed(Exception):
    """The set-up sandbox could not be recorded for clean evaluations (INIT fails: SANDBOX_START)."""


@dataclass(eq=False)
class CleanBase:
    """What the clean sandboxes of the rollouts of one INIT are made from: the manifests of the
    set-up sandbox (one per change the tasks name) and a named snapshot of it (None: a new sandbox
    of the task, set up again). `holders`: the rollouts that still may evaluate from it."""

    manifests: dict[bytes, Manifest]  # by spec_key
    snapshot: str | None = None
    holders: int = 0
    # Why there is no snapshot, for the evaluation's output.
    no_snapshot: str = ""
    released: bool = field(default=False, repr=False)


async def record_clean_base(
    client: AsyncClient, sandbox: AsyncSandbox, tasks: Iterable[pb.Task], *, snapshot: bool
) -> tuple[CleanBase, str | None]:
    """Records the set-up `sandbox` for the clean evaluations of `tasks`: their manifests, and a
    named snapshot when `snapshot` (and no task's setup is per rollout). Returns the base and,
    when the backend cannot snapshot at all (FAILED_PRECONDITION), why (the caller remembers it
    and stops asking). Raises CleanBaseFailed. Cancelled midway, it leaves no snapshot."""
    tasks = [task for task in tasks if not evaluates_in_place(task)]
    workdir = sandbox.info.workdir
    specs = {spec_key(task.evaluation): change_spec(task.evaluation, workdir) for task in tasks}
    try:
        manifests = await asyncio.gather(*(take_manifest(sandbox, spec) for spec in specs.values()))
    except (ChangeTooLarge, ChangeUnreadable) as error:
        raise CleanBaseFailed(f"recording the set-up sandbox for the evaluation failed: {error}") from error
    base = CleanBase(manifests=dict(zip(specs, manifests)))
    cannot = None
    if any(task.setup.per_rollout for task in tasks):
        base.no_snapshot = "the setup runs per rollout (a fork would not have its processes)"
    elif not snapshot:
        base.no_snapshot = "the backend cannot fork"
    else:
        name = f"corral-eval-{secrets.token_hex(8)}"
        taking = asyncio.ensure_future(sandbox.snapshot(name))
        try:
            await asyncio.shield(taking)
            base.snapshot = name
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(taking, CANCELLED_CREATE_TIMEOUT_S)
                await client.delete_snapshot(name)
            raise
        except FailedPrecondition as error:
            base.no_snapshot = cannot = str(error)
        except CorralError as error:
            base.no_snapshot = f"the snapshot failed: {error}"
            _log.warning("snapshotting sandbox %s for clean evaluations failed: %s", sandbox.id, error)
    return base, cannot


async def release_clean_base(client: AsyncClient, base: CleanBase) -> None:
    """Deletes the base's snapshot (once; errors are logged: a daemon's restart removes it too)."""
    if base.released:
        return
    base.released = True
    if base.snapshot is not None:
        try:
            await client.delete_snapshot(base.snapshot)
        except NotFound:
            pass
        except CorralError as error:
            _log.warning("deleting snapshot %s failed: %s", base.snapshot, error)


@dataclass(frozen=True)
class CleanSandbox:
    sandbox: AsyncSandbox
    source: pb.EvalSandbox


async def start_clean_sandbox(
    client: AsyncClient, task: pb.Task, base: CleanBase, *, rollout_id: str, retries: int, action_timeout_s: float
) -> CleanSandbox:
    """A sandbox of the task's clean INIT state, labelled with the rollout: a fork of the base's
    snapshot (retried as INIT's forks are), else a new sandbox of the task, set up again. Raises
    EvaluationInfraError; cancelled midway, it leaves no sandbox."""
    if base.snapshot is not None:
        try:
            forked = await _fork_snapshot(client, task, base.snapshot, rollout_id=rollout_id, retries=retries)
            return CleanSandbox(forked, pb.EVAL_SANDBOX_SNAPSHOT_FORK)
        except NotFound:
            _log.warning("%s: the snapshot %s is gone: a new sandbox instead", rollout_id, base.snapshot)
    try:
        sandbox = await start_task_sandbox(
            client, task, rollout_id=rollout_id, retries=retries, action_timeout_s=action_timeout_s
        )
    except SandboxStartFailed as error:
        raise EvaluationInfraError(f"starting the clean sandbox failed: {error}") from error
    return CleanSandbox(sandbox, pb.EVAL_SANDBOX_NEW)


async def _fork_snapshot(
    client: AsyncClient, task: pb.Task, name: str, *, rollout_id: str, retries: int
) -> AsyncSandbox:
    attempts = retries + 1
    labels = {ROLLOUT_LABEL: rollout_id, TASK_LABEL: task.task_id}
    for attempt in range(1, attempts + 1):
        forking = asyncio.ensure_future(client.fork_snapshot(name, 1, labels=labels))
        try:
            (child,) = await asyncio.shield(forking)
            return child
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                children = await asyncio.wait_for(forking, CANCELLED_CREATE_TIMEOUT_S)
                await asyncio.gather(*(c.destroy() for c in children), return_exceptions=True)
            raise
        except NotFound:
            raise
        except CorralError as error:
            if attempt == attempts:
                raise EvaluationInfraError(f"forking the clean snapshot failed {attempts} times: {error}") from error
            _log.warning(
                "%s: forking snapshot %s failed (attempt %d of %d): %s", rollout_id, name, attempt, attempts, error
            )
        await asyncio.sleep(min(INIT_RETRY_BACKOFF_S * 2 ** (attempt - 1), INIT_RETRY_MAX_BACKOFF_S))
    raise AssertionError("unreachable")


def describe_source(source: pb.EvalSandbox, base: CleanBase) -> str:
    if source == pb.EVAL_SANDBOX_SNAPSHOT_FORK:
        return "a fork of the set-up sandbox's snapshot"
    return f"a new sandbox of the task, set up again ({base.no_snapshot or 'no snapshot'})"


async def evaluate_clean(
    client: AsyncClient,
    agent: AsyncSandbox,
    task: pb.Task,
    base: CleanBase,
    *,
    rollout_id: str,
    retries: int,
    action_timeout_s: float,
    command_timeout_s: float,
    release_agent: Callable[[], Awaitable[Awaitable[None] | None]],
    hold: Callable[[AsyncSandbox], None],
    timings: dict[str, float],
) -> tuple[Evaluation, pb.EvalSandbox]:
    """The clean evaluation of a rollout: its change read from `agent` against the base's
    manifest, then `release_agent()` (the caller destroys the agent's sandbox, or starts to and
    returns what to await for it to be gone), a clean sandbox started and handed to `hold` (the
    caller destroys it when the rollout ends), the change applied and the evaluation run there.
    Fills `timings` ("eval_change", "eval_sandbox"). A change past the caps is reward 0 without a
    clean sandbox. Raises EvaluationInfraError."""
    watch = Stopwatch()
    spec = change_spec(task.evaluation, agent.info.workdir)
    manifest = base.manifests.get(spec_key(task.evaluation))
    if manifest is None:
        raise EvaluationInfraError(f"no record of the set-up sandbox for the change at {spec.root}")
    try:
        change = await capture_change(agent, spec, manifest)
    except ChangeTooLarge as error:
        timings["eval_change"] = watch.lap()
        return Evaluation(0.0, f"[corral] reward 0: {error}\n".encode()), pb.EVAL_SANDBOX_UNSPECIFIED
    except ChangeUnreadable as error:
        raise EvaluationInfraError(f"reading the agent's change failed: {error}") from error
    timings["eval_change"] = watch.lap()
    agent_gone = await release_agent()
    try:
        clean = await start_clean_sandbox(
            client, task, base, rollout_id=rollout_id, retries=retries, action_timeout_s=action_timeout_s
        )
    except EvaluationInfraError:
        if agent_gone is None:
            raise
        # The node may have refused it for what the agent's sandbox still held (its ids, its
        # memory): once more when that is gone.
        await agent_gone
        clean = await start_clean_sandbox(
            client, task, base, rollout_id=rollout_id, retries=retries, action_timeout_s=action_timeout_s
        )
    hold(clean.sandbox)
    timings["eval_sandbox"] = watch.lap()
    evaluation = await evaluate(
        clean.sandbox,
        task.evaluation,
        command_timeout_s=command_timeout_s,
        change=change,
        spec=change_spec(task.evaluation, clean.sandbox.info.workdir),
        note=f"evaluated in {describe_source(clean.source, base)}",
    )
    return evaluation, clean.source


class Stopwatch:
    """Seconds since it was made, and between laps."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        return elapsed
