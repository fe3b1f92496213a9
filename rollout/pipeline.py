"""The rollout pipeline: INIT (create the sandbox, set the task up), RUN (the agent loop) and EVAL
(evaluation and reward), each stage a pool of workers fed by a bounded queue.

- A stage's timeout counts from when one of its workers takes the rollout: time queued is
  excluded (and reported apart in the timings).
- Bounded queues give backpressure: `submit` waits while the INIT queue is full, and a stage whose
  next queue is full holds its rollout (and its worker) until there is room.
- Results are delivered one by one as rollouts finish, in completion order; samples of one task
  share a group id but never wait for each other.
- Infrastructure failures become FILTERED results with a reason, never reward 0.
- Every sandbox is destroyed when its rollout ends, whichever way it ends (result, filter,
  cancel, shutdown). Cancelling frees it at once.
- INIT once (shared_init.py): rollouts that may share their INIT wait for one sandbox start and
  setup, then each gets a fork of that sandbox; the set-up sandbox is destroyed once they exist.
- The pipeline's sandboxes never fill the node past `max_sandboxes` (room.py): an INIT waits for
  room among them (time queued, not timed) rather than be refused while its own rollouts' sandboxes
  wait for RUN or EVAL or are still being torn down.
- EVAL runs in a clean sandbox with the agent's change (clean_eval.py) unless the task opts in to
  its own sandbox: INIT records the set-up sandbox (a manifest of the change's trees, a snapshot
  where the backend can make one); EVAL reads the change, destroys the agent's sandbox and starts
  the clean one in its place (beside it while it is torn down only where the node has room).

Sandboxes are reached through the SDK's AsyncClient, over the daemon's own socket: the pipeline
uses exactly the interface trainers use, and the trainer adapters reuse its pieces.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from corral.rollout import results
from corral.rollout.agent_loop import AgentLimits, AgentLoop
from corral.rollout.clean_eval import (
    CleanBase,
    CleanBaseFailed,
    evaluate_clean,
    evaluates_in_place,
    record_clean_base,
    release_clean_base,
)
from corral.rollout.evaluation import (
    Evaluation,
    EvaluationInfraError,
    SandboxStartFailed,
    evaluate,
    start_task_sandbox,
)
from corral.rollout.gateway import Gateway, GatewayCounters, GatewayOutcome, HistoryPolicy, SessionSettings
from corral.rollout.harness import HarnessExit, HarnessHost, run_harness
from corral.rollout.room import SandboxRoom
from corral.rollout.shared_init import ForkFailed, ForkUnavailable, SharedInit, fork_children, may_share, sharing_key
from corral.rollout.tasks import (
    check_task,
    enabled_tools,
    is_harness_task,
    render_messages,
    runs_on_host,
    sampling_options,
    task_limits,
    tool_call_format,
)
from corral.rollout.tools import SandboxToolBox
from corral.rollout.types import (
    ChatTokenizer,
    FinishReason,
    GenerateFn,
    LLMUnavailable,
    SandboxFailure,
    Trajectory,
    TurnRecord,
)
from corral.sdk import AsyncClient, AsyncSandbox, CorralError, FailedPrecondition, Unavailable
from corral.v1 import rollout_pb2 as pb

_log = logging.getLogger(__name__)

# How long destroying one sandbox may take before the pipeline gives up on it (the daemon's idle
# reaper and shutdown still remove it).
DESTROY_TIMEOUT_S = 60.0
THROUGHPUT_WINDOW_S = 60.0


class Stage(enum.Enum):
    INIT = "init"
    RUN = "run"
    EVAL = "eval"


@dataclass(frozen=True)
class StageSettings:
    workers: int
    timeout_s: float
    queue_size: int = 1024


@dataclass(frozen=True)
class PipelineSettings:
    init: StageSettings = StageSettings(workers=8, timeout_s=300.0)
    run: StageSettings = StageSettings(workers=64, timeout_s=1800.0)
    eval: StageSettings = StageSettings(workers=8, timeout_s=600.0)
    # Further attempts at creating and setting up a sandbox after an infrastructure failure.
    init_retries: int = 2
    # Whether harness tasks may run their command on the node, outside the sandbox.
    allow_host_harness: bool = False
    # INIT once: the samples of one submission, and tasks sharing a setup key, start and set up
    # one sandbox and fork it into theirs (shared_init.py). Off: every rollout runs its own INIT.
    init_once: bool = True
    # The most sandboxes the rollouts may hold on the node at once, their teardowns included (the
    # daemon's daemon.max_sandboxes): an INIT waits for room among them (room.py). 0: no limit.
    max_sandboxes: int = 0

    def stage(self, stage: Stage) -> StageSettings:
        return getattr(self, stage.value)


# A harness task's history policy, as the gateway names it.
HISTORY_POLICIES = {
    pb.HISTORY_POLICY_UNSPECIFIED: HistoryPolicy.SPLIT,
    pb.HISTORY_POLICY_SPLIT: HistoryPolicy.SPLIT,
    pb.HISTORY_POLICY_MASK: HistoryPolicy.MASK,
    pb.HISTORY_POLICY_FAIL: HistoryPolicy.FAIL,
}


class NoLLMServers(FailedPrecondition):
    """Nothing to generate with: no LLM server is registered."""


class PipelineClosed(Unavailable):
    """The pipeline is shutting down and takes no more rollouts."""


async def _stage_work_done(work: asyncio.Task) -> None:
    """Waits for a stage's work to end. When the worker waiting is cancelled (the pipeline is
    closing), the work is cancelled too, unless a cancel (of its rollouts) is already under way:
    a second one could cut its cleanup short."""
    try:
        await asyncio.wait({work})
    except asyncio.CancelledError:
        if not work.cancelling():
            work.cancel()
        await asyncio.wait({work})
        raise


class RolloutFiltered(Exception):
    """A rollout ends as FILTERED with this reason."""

    def __init__(self, reason: pb.FilterReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


ResultSink = Callable[[pb.RolloutResult], None]
TurnSink = Callable[[pb.Turn], None]


@dataclass(eq=False)
class Rollout:
    """One rollout on its way through the stages."""

    rollout_id: str
    task: pb.Task
    options: pb.RolloutOptions
    group_id: str
    sample_index: int
    deliver: ResultSink
    on_turn: TurnSink | None = None
    # Who submitted it, as the daemon names its callers (opaque here): its sandboxes are theirs.
    submitter: str = ""
    submitted_at: float = field(default_factory=time.monotonic)
    enqueued_at: float = 0.0
    # When the stage in progress began its work (for INIT: once there was room for its sandbox).
    started_at: float = 0.0
    # Seconds per stage and per stage queue ("init_queue", "init", ...), for StageTimings.
    timings: dict[str, float] = field(default_factory=dict)
    sandbox: AsyncSandbox | None = None
    # The room (room.py) it holds: 1 from its INIT's start until its sandbox is destroyed.
    room: int = 0
    trajectory: Trajectory | None = None
    # A harness rollout's samples after the first (in `trajectory`), and its gateway counters.
    extra_samples: list[Trajectory] = field(default_factory=list)
    gateway_counters: GatewayCounters | None = None
    evaluation: Evaluation | None = None
    # The stage work in progress, cancelled by `cancel`.
    active: asyncio.Task | None = None
    # Why it is being stopped early: FILTER_REASON_SHUTDOWN for shutdown, None for a client cancel.
    stop_reason: pb.FilterReason | None = None
    finished: bool = False
    # The INIT it waits for with others (INIT once), how many shared it (0: its own), and whether
    # it was to share one but the backend cannot fork.
    shared_init: SharedInit[Rollout] | None = None
    init_shared_by: int = 0
    init_fell_back: bool = False
    # What its clean evaluation starts from (shared by the rollouts of one INIT), and where its
    # evaluation ran.
    clean_base: CleanBase | None = None
    eval_sandbox: pb.EvalSandbox = pb.EVAL_SANDBOX_UNSPECIFIED


class StageCounters:
    def __init__(self) -> None:
        self.in_flight = 0
        self.completed = 0
        self._recent: collections.deque[float] = collections.deque()

    def record_completion(self) -> None:
        self.completed += 1
        now = time.monotonic()
        self._recent.append(now)
        while self._recent and self._recent[0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def throughput(self) -> float:
        now = time.monotonic()
        while self._recent and self._recent[0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return len(self._recent) / THROUGHPUT_WINDOW_S


class RolloutPipeline:
    """Runs rollouts through INIT, RUN and EVAL. `start()` before use, `close()` at the end."""

    def __init__(
        self,
        client: AsyncClient,
        generate: GenerateFn,
        tokenizer: ChatTokenizer,
        *,
        settings: PipelineSettings = PipelineSettings(),
        has_llm: Callable[[], bool] = lambda: True,
        forget_rollout: Callable[[str], None] = lambda rollout_id: None,
        context_length: Callable[[], Awaitable[int | None]] | None = None,
    ) -> None:
        self._client = client
        self._generate = generate
        self._tokenizer = tokenizer
        self._settings = settings
        self._has_llm = has_llm
        # Told when a rollout ends, so the LLM pool drops the rollout's server affinity.
        self._forget_rollout = forget_rollout
        # The LLM servers' context window (the agent loop ends a rollout as CONTEXT_FULL within it).
        self._context_length = context_length
        self._queues = {
            stage: asyncio.Queue[Rollout | SharedInit[Rollout]](settings.stage(stage).queue_size) for stage in Stage
        }
        self._counters = {stage: StageCounters() for stage in Stage}
        self._room = SandboxRoom(settings.max_sandboxes)
        self._workers: list[asyncio.Task] = []
        self._finishing: set[asyncio.Task] = set()
        self._live: dict[str, Rollout] = {}
        # Shared INITs not yet finished, by their id (the set-up sandbox's rollout label); those
        # that still take members, by sharing key (only tasks with a setup key join across
        # submissions); and the backends that answered that they cannot fork, with why.
        self._shared_inits: dict[str, SharedInit[Rollout]] = {}
        self._open_inits: dict[bytes, SharedInit[Rollout]] = {}
        self._cannot_fork: dict[int, str] = {}
        # Backends that answered that they cannot snapshot (clean evaluations start new sandboxes).
        self._cannot_snapshot: dict[int, str] = {}
        self._closed = False
        self.policy_version = 0
        self.totals = collections.Counter[int]()
        # Harness tasks need the daemon's LLM gateway (enable_harnesses); without it they are refused.
        self._gateway: Gateway | None = None
        self._harness_host: HarnessHost | None = None
        self._on_session_closed: Callable[[GatewayCounters], None] = lambda counters: None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        for stage in Stage:
            for number in range(self._settings.stage(stage).workers):
                self._workers.append(asyncio.create_task(self._work(stage), name=f"rollout-{stage.value}-{number}"))

    async def close(self) -> None:
        """Stops taking rollouts, ends every unfinished one as FILTERED (reason SHUTDOWN) and
        destroys their sandboxes."""
        self._closed = True
        for rollout in list(self._live.values()):
            self._stop(rollout, pb.FILTER_REASON_SHUTDOWN)
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        # Rollouts still sitting in a queue had no worker to end them.
        for rollout in list(self._live.values()):
            self._finish(rollout, self._filtered(rollout, pb.FILTER_REASON_SHUTDOWN, "the daemon shut down"))
        while self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)

    def enable_harnesses(
        self,
        gateway: Gateway,
        host: HarnessHost,
        *,
        on_session_closed: Callable[[GatewayCounters], None] = lambda counters: None,
    ) -> None:
        """Lets harness tasks run: their LLM calls go through `gateway`; `on_session_closed` gets
        each rollout's counters (the daemon's metrics)."""
        self._gateway = gateway
        self._harness_host = host
        self._on_session_closed = on_session_closed

    # -- the API the service uses ----------------------------------------------------------------

    async def submit(
        self,
        task: pb.Task,
        options: pb.RolloutOptions,
        deliver: ResultSink,
        on_turn: TurnSink | None = None,
        *,
        submitter: str = "",
    ) -> list[Rollout]:
        """Queues `options.n` rollouts of a task (waiting while the INIT queue is full) and returns
        them. Each result goes to `deliver` when it is ready. `submitter` is who submitted them
        (submitter_of). Raises TaskError, NoLLMServers, PipelineClosed."""
        if self._closed:
            raise PipelineClosed("the daemon is shutting down")
        check_task(task)
        self._check_harness_allowed(task)
        if not self._has_llm():
            raise NoLLMServers("no LLM server is registered: call RegisterLLM first")
        group_id = options.group_id or secrets.token_hex(6)
        rollouts = [
            Rollout(
                rollout_id=f"{task.task_id}/{index}/{secrets.token_hex(4)}",
                task=task,
                options=options,
                group_id=group_id,
                sample_index=index,
                deliver=deliver,
                on_turn=on_turn if options.stream_turns else None,
                submitter=submitter,
            )
            for index in range(options.n or 1)
        ]
        for rollout in rollouts:
            self._live[rollout.rollout_id] = rollout
        if self._settings.init_once and may_share(task, len(rollouts)):
            if task.backend not in self._cannot_fork:
                await self._join_shared_inits(rollouts)
                return rollouts
            for rollout in rollouts:
                rollout.init_fell_back = True
        for rollout in rollouts:
            await self._enqueue(Stage.INIT, rollout)
        return rollouts

    async def _join_shared_inits(self, rollouts: list[Rollout]) -> None:
        """Puts the rollouts of a submission into shared INITs: the open one of their setup key
        (if any) while it has room, then new ones, each queued for an INIT worker."""
        task = rollouts[0].task
        key = sharing_key(task, rollouts[0].submitter) if task.setup_key else None
        group = self._open_inits.get(key) if key is not None else None
        for rollout in rollouts:
            rollout.enqueued_at = time.monotonic()
            if group is not None and not group.full:
                group.members.append(rollout)
                rollout.shared_init = group
                continue
            group = SharedInit[Rollout](task=rollout.task, members=[rollout], key=key)
            rollout.shared_init = group
            self._shared_inits[group.init_id] = group
            if key is not None:
                self._open_inits[key] = group
            await self._queues[Stage.INIT].put(group)

    def _check_harness_allowed(self, task: pb.Task) -> None:
        if not is_harness_task(task):
            return
        if self._gateway is None:
            raise FailedPrecondition(
                f"task {task.task_id}: no LLM gateway serves this pipeline, so it runs no harness tasks"
            )
        if runs_on_host(task) and not self._settings.allow_host_harness:
            raise FailedPrecondition(
                f"task {task.task_id}: this daemon does not run harnesses on the node "
                "([rollout] allow_host_harness = false); set harness.place to SANDBOX"
            )

    def cancel(self, rollout_id: str) -> bool:
        """Cancels a rollout (result status CANCELLED) and destroys its sandbox at once. False if
        it is unknown or already finished."""
        rollout = self._live.get(rollout_id)
        if rollout is None:
            return False
        self._stop(rollout, None)
        return True

    def set_policy_version(self, version: int) -> None:
        if version < self.policy_version:
            raise FailedPrecondition(f"policy version {version} is older than the current {self.policy_version}")
        self.policy_version = version

    def stage_stats(self, stage: Stage) -> pb.StageStats:
        counters = self._counters[stage]
        queued = self._queues[stage].qsize()
        if stage is Stage.INIT:  # a queued shared INIT is one entry for all its rollouts
            queued += sum(len(g.waiting()) - 1 for g in self._shared_inits.values() if g.taken_at is None)
        return pb.StageStats(
            queued=max(queued, 0),
            in_flight=counters.in_flight,
            workers=self._settings.stage(stage).workers,
            completed=counters.completed,
            throughput_per_s=counters.throughput(),
        )

    @property
    def room(self) -> SandboxRoom:
        """The node's room for the rollouts' sandboxes (read it; the pipeline takes and gives)."""
        return self._room

    @property
    def live_count(self) -> int:
        return len(self._live)

    def is_live(self, rollout_id: str) -> bool:
        """Whether a rollout (or an INIT shared by rollouts: its set-up sandbox carries the shared
        INIT's id as its rollout label) was accepted and has not ended yet."""
        return rollout_id in self._live or rollout_id in self._shared_inits

    def submitter_of(self, rollout_id: str) -> str | None:
        """Who submitted a live rollout, or the rollouts of a live shared INIT (one submitter's
        only: sharing_key); None when `rollout_id` is neither."""
        rollout = self._live.get(rollout_id)
        if rollout is not None:
            return rollout.submitter
        group = self._shared_inits.get(rollout_id)
        return group.members[0].submitter if group is not None and group.members else None

    # -- stages --------------------------------------------------------------------------------

    async def _enqueue(self, stage: Stage, rollout: Rollout) -> None:
        rollout.enqueued_at = time.monotonic()
        await self._queues[stage].put(rollout)

    async def _work(self, stage: Stage) -> None:
        queue = self._queues[stage]
        counters = self._counters[stage]
        while True:
            item = await queue.get()
            if isinstance(item, SharedInit):
                await self._work_shared_init(item)
                continue
            rollout = item
            if rollout.finished:  # cancelled while it waited
                continue
            rollout.started_at = time.monotonic()
            counters.in_flight += 1
            work = asyncio.create_task(self._run_stage(stage, rollout))
            rollout.active = work
            try:
                await _stage_work_done(work)
            finally:
                counters.in_flight -= 1
                rollout.active = None
                rollout.timings[f"{stage.value}_queue"] = rollout.started_at - rollout.enqueued_at
                rollout.timings[stage.value] = time.monotonic() - rollout.started_at
            counters.record_completion()
            next_stage = await self._after_stage(stage, rollout, work)
            if next_stage is not None:
                await self._enqueue(next_stage, rollout)

    async def _after_stage(self, stage: Stage, rollout: Rollout, work: asyncio.Task) -> Stage | None:
        """Ends the rollout or names the stage it goes to next."""
        if work.cancelled():
            if rollout.stop_reason is not None:
                self._finish(rollout, self._filtered(rollout, rollout.stop_reason, "the daemon shut down"))
            else:
                self._finish(
                    rollout, self._result(rollout, pb.ROLLOUT_STATUS_CANCELLED, error="cancelled by the client")
                )
            return None
        error = work.exception()
        if isinstance(error, RolloutFiltered):
            self._finish(rollout, self._filtered(rollout, error.reason, str(error)))
            return None
        if error is not None:
            _log.error("rollout %s: unexpected failure in %s", rollout.rollout_id, stage.value, exc_info=error)
            reason = {
                Stage.INIT: pb.FILTER_REASON_SANDBOX_START,
                Stage.RUN: pb.FILTER_REASON_BACKEND_CRASH,
                Stage.EVAL: pb.FILTER_REASON_EVAL_INFRA,
            }[stage]
            self._finish(rollout, self._filtered(rollout, reason, f"{type(error).__name__}: {error}"))
            return None
        if stage is Stage.INIT:
            return Stage.RUN
        if stage is Stage.RUN:
            return Stage.EVAL
        self._finish(rollout, self._completed(rollout))
        return None

    async def _run_stage(self, stage: Stage, rollout: Rollout) -> None:
        timeout = self._stage_timeout(stage, rollout.task)
        if stage is Stage.INIT:
            await self._init(rollout, timeout)
        elif stage is Stage.RUN:
            await self._run(rollout, timeout)
            self._check_staleness(rollout)
        else:
            await self._eval(rollout, timeout)
            self._check_staleness(rollout)

    def _stage_timeout(self, stage: Stage, task: pb.Task) -> float:
        limits = task_limits(task)
        own = {Stage.INIT: limits.init_timeout_s, Stage.RUN: limits.run_timeout_s, Stage.EVAL: limits.eval_timeout_s}[
            stage
        ]
        return own or self._settings.stage(stage).timeout_s

    async def _init(self, rollout: Rollout, timeout_s: float) -> None:
        limits = task_limits(rollout.task)
        await self._room.take(1)
        rollout.room = 1
        rollout.started_at = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                rollout.sandbox = await start_task_sandbox(
                    self._client,
                    rollout.task,
                    rollout_id=rollout.rollout_id,
                    retries=self._settings.init_retries,
                    action_timeout_s=limits.action_timeout_s,
                )
                if not evaluates_in_place(rollout.task):
                    base = await self._record_clean_base(rollout.sandbox, [rollout.task])
                    self._hold_clean_base(rollout, base)
        except SandboxStartFailed as error:
            raise RolloutFiltered(pb.FILTER_REASON_SANDBOX_START, str(error)) from error
        except CleanBaseFailed as error:
            raise RolloutFiltered(pb.FILTER_REASON_SANDBOX_START, str(error)) from error
        except TimeoutError:
            raise RolloutFiltered(pb.FILTER_REASON_STAGE_TIMEOUT, f"INIT ran past its {timeout_s:g} s") from None

    async def _record_clean_base(self, sandbox: AsyncSandbox, tasks: list[pb.Task]) -> CleanBase:
        """The set-up sandbox recorded for the clean evaluations of `tasks` (clean_eval.py), with
        a snapshot unless its backend said it cannot make one. Raises CleanBaseFailed."""
        backend = tasks[0].backend
        base, cannot = await record_clean_base(
            self._client, sandbox, tasks, snapshot=backend not in self._cannot_snapshot
        )
        if cannot is not None:
            self._cannot_snapshot[backend] = cannot
            _log.info("clean evaluations start new sandboxes on this backend: %s", cannot)
        elif backend in self._cannot_snapshot:
            base.no_snapshot = self._cannot_snapshot[backend]
        return base

    @staticmethod
    def _hold_clean_base(rollout: Rollout, base: CleanBase | None) -> None:
        if base is not None and not evaluates_in_place(rollout.task):
            rollout.clean_base = base
            base.holders += 1

    async def _release_clean_base(self, rollout: Rollout) -> None:
        base, rollout.clean_base = rollout.clean_base, None
        if base is not None:
            base.holders -= 1
            if base.holders <= 0:
                await release_clean_base(self._client, base)

    def _release_unheld(self, base: CleanBase | None) -> None:
        """Deletes, in the background, the snapshot of a base no rollout took."""
        if base is None or base.holders > 0:
            return
        task = asyncio.create_task(release_clean_base(self._client, base))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    # -- INIT once ------------------------------------------------------------------------------

    async def _work_shared_init(self, group: SharedInit[Rollout]) -> None:
        """An INIT worker's turn at a shared INIT: as _work for one rollout, for all its members."""
        counters = self._counters[Stage.INIT]
        group.taken_at = time.monotonic()
        counters.in_flight += 1
        work = asyncio.create_task(self._shared_init(group))
        group.active = work
        try:
            await _stage_work_done(work)
        finally:
            counters.in_flight -= 1
            group.active = None
            self._close_membership(group)
            self._shared_inits.pop(group.init_id, None)
            # The room of sandboxes it did not make, or made and destroyed already.
            self._room.give_back(group.room)
            group.room = 0
        await self._after_shared_init(group, work)

    def _close_membership(self, group: SharedInit[Rollout]) -> list[Rollout]:
        """No rollout joins `group` any more; returns its members still waiting."""
        if group.key is not None and self._open_inits.get(group.key) is group:
            del self._open_inits[group.key]
        return group.close()

    async def _shared_init(self, group: SharedInit[Rollout]) -> None:
        """Starts and sets up one sandbox for the group, forks it into one per waiting member and
        destroys it. A backend that cannot fork: the first member takes the set-up sandbox and
        the others run INITs of their own (_after_shared_init). Raises RolloutFiltered."""
        task = group.task
        timeout_s = self._stage_timeout(Stage.INIT, task)
        parent: AsyncSandbox | None = None
        base: CleanBase | None = None
        if not group.waiting():  # every member was cancelled while it queued
            return
        # Room for the set-up sandbox and a child per member (members joining from now on are
        # counted when the fork begins).
        room = 1 + len(group.waiting())
        await self._room.take(room)
        group.room = room
        group.started_at = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                parent = await start_task_sandbox(
                    self._client,
                    task,
                    rollout_id=group.init_id,
                    retries=self._settings.init_retries,
                    action_timeout_s=task_limits(task).action_timeout_s,
                )
                members = self._close_membership(group)
                clean = [member.task for member in members if not evaluates_in_place(member.task)]
                if clean:
                    base = await self._record_clean_base(parent, clean)
                group.set_up_at = time.monotonic()
                group.shared_by = len(members)
                if len(members) <= 1:  # nobody left to share with: no fork needed
                    if members:
                        members[0].sandbox, parent = parent, None
                        self._hand_room(group, members[0])
                        self._hold_clean_base(members[0], base)
                    return
                self._fit_room(group, 1 + len(members))
                try:
                    children, group.fork_s = await fork_children(
                        parent, len(members), retries=self._settings.init_retries
                    )
                except ForkUnavailable as error:
                    self._cannot_fork[task.backend] = str(error)
                    group.fell_back = True
                    _log.info("INIT once falls back to an INIT per rollout: %s", error)
                    first = next((m for m in members if not m.finished), None)
                    if first is not None:
                        first.sandbox, parent = parent, None
                        self._hand_room(group, first)
                        self._hold_clean_base(first, base)
                    return
                for member, child in zip(members, children):
                    group.room -= 1
                    if member.finished:  # cancelled during the fork
                        self._destroy_later(child, member.rollout_id, room=1)
                    else:
                        member.sandbox = child
                        member.room += 1
                        self._hold_clean_base(member, base)
        except (SandboxStartFailed, CleanBaseFailed) as error:
            raise RolloutFiltered(pb.FILTER_REASON_SANDBOX_START, str(error)) from error
        except ForkFailed as error:
            raise RolloutFiltered(pb.FILTER_REASON_FORK_FAILED, str(error)) from error
        except TimeoutError:
            raise RolloutFiltered(pb.FILTER_REASON_STAGE_TIMEOUT, f"INIT ran past its {timeout_s:g} s") from None
        finally:
            if parent is not None:
                group.room -= 1
                self._destroy_later(parent, group.init_id, room=1)
            self._release_unheld(base)

    @staticmethod
    def _hand_room(group: SharedInit[Rollout], member: Rollout) -> None:
        """The room of the sandbox `member` takes from the shared INIT goes with it."""
        group.room -= 1
        member.room += 1

    def _fit_room(self, group: SharedInit[Rollout], needed: int) -> None:
        """The room of a shared INIT about to fork, as its members now need: what members that
        left held goes back; members that joined after it took its room take theirs without
        waiting (it holds a set-up sandbox already, and waiting while holding one could wait for
        other INITs that wait likewise)."""
        if needed < group.room:
            self._room.give_back(group.room - needed)
        elif needed > group.room:
            self._room.take_now(needed - group.room)
        group.room = needed

    async def _after_shared_init(self, group: SharedInit[Rollout], work: asyncio.Task) -> None:
        """Sends each waiting member on: to RUN with its sandbox, back to INIT for one of its own
        (the backend cannot fork), or to its end as FILTERED."""
        error = None if work.cancelled() else work.exception()
        if error is not None and not isinstance(error, RolloutFiltered):
            _log.error("shared INIT %s: unexpected failure", group.init_id, exc_info=error)
            error = RolloutFiltered(pb.FILTER_REASON_SANDBOX_START, f"{type(error).__name__}: {error}")
        ended = time.monotonic()
        for member in group.members:
            if member.finished:
                continue
            self._note_shared_init(group, member, ended)
            if error is None and member.sandbox is None and group.fell_back:
                member.shared_init = None
                await self._queues[Stage.INIT].put(member)  # its INIT queue time runs on from joining
                continue
            self._counters[Stage.INIT].record_completion()
            if isinstance(error, RolloutFiltered):
                self._finish(member, self._filtered(member, error.reason, str(error)))
            elif member.sandbox is not None:
                await self._enqueue(Stage.RUN, member)
            else:  # the INIT was cancelled under it (the pipeline closing)
                self._finish(
                    member,
                    self._filtered(member, member.stop_reason or pb.FILTER_REASON_SHUTDOWN, "INIT was cut short"),
                )

    @staticmethod
    def _note_shared_init(group: SharedInit[Rollout], member: Rollout, ended: float) -> None:
        """A member's INIT timings: its wait for a worker, the shared INIT from when it joined,
        and the fork."""
        assert group.taken_at is not None
        started = max(group.started_at or group.taken_at, member.enqueued_at)
        member.timings["init_queue"] = started - member.enqueued_at
        member.timings["init"] = (group.set_up_at or ended) - started
        if group.fork_s is not None:
            member.timings["fork"] = group.fork_s
            member.init_shared_by = group.shared_by
        member.init_fell_back = group.fell_back

    async def _run(self, rollout: Rollout, timeout_s: float) -> None:
        if is_harness_task(rollout.task):
            await self._run_harness(rollout, timeout_s)
            return
        task = rollout.task
        assert rollout.sandbox is not None
        limits = task_limits(task)
        tools = SandboxToolBox(
            rollout.sandbox,
            enabled_tools(task),
            workdir=rollout.sandbox.info.workdir,
            max_observation_bytes=limits.max_observation_bytes,
        )
        loop = AgentLoop(
            self._tokenizer,
            self._generate,
            tools,
            limits=AgentLimits(
                max_turns=limits.max_turns,
                max_new_tokens_per_turn=limits.max_new_tokens_per_turn,
                max_total_tokens=limits.max_total_tokens,
                action_timeout_s=limits.action_timeout_s,
            ),
            tool_call_format=tool_call_format(task),
            sampling=sampling_options(task, limits.max_new_tokens_per_turn),
            rollout_id=rollout.rollout_id,
            policy_version=lambda: self.policy_version,
            on_turn=self._turn_sink(rollout),
            context_length=self._context_length,
        )
        rollout.trajectory = loop.trajectory
        try:
            async with asyncio.timeout(timeout_s):
                await loop.run(render_messages(task))
        except TimeoutError:
            loop.trajectory.finish_reason = FinishReason.TIMEOUT
        except LLMUnavailable as error:
            raise RolloutFiltered(pb.FILTER_REASON_LLM_UNREACHABLE, str(error)) from error
        except (SandboxFailure, CorralError) as error:
            raise RolloutFiltered(pb.FILTER_REASON_BACKEND_CRASH, str(error)) from error
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(tools.close(), 10)

    async def _run_harness(self, rollout: Rollout, timeout_s: float) -> None:
        """RUN for a harness task: its command talks to a gateway session of its own; the
        trajectory is what the session recorded. Filtered as the agent loop is: the LLM failing
        (LLM_UNREACHABLE), the sandbox failing (BACKEND_CRASH); and the harness failing by itself
        (HARNESS_FAILED) or rewriting its history under policy FAIL (HISTORY_REWRITTEN)."""
        task = rollout.task
        assert rollout.sandbox is not None and self._gateway is not None and self._harness_host is not None
        limits = task_limits(task)
        session = self._gateway.open_session(
            rollout.rollout_id,
            SessionSettings(
                sampling=sampling_options(task, limits.max_new_tokens_per_turn),
                max_new_tokens_per_turn=limits.max_new_tokens_per_turn,
                max_total_tokens=limits.max_total_tokens,
                max_calls=limits.max_turns,
                tool_call_format=tool_call_format(task),
                history_policy=HISTORY_POLICIES[task.harness.history_policy],
            ),
        )
        ended: HarnessExit | None = None
        try:
            async with asyncio.timeout(timeout_s):
                ended = await run_harness(
                    task, rollout.sandbox, rollout_id=rollout.rollout_id, key=session.key, host=self._harness_host
                )
            if ended is not None and not ended.succeeded:
                await self._check_sandbox_alive(rollout.sandbox)
        except TimeoutError:
            pass
        except (SandboxFailure, CorralError) as error:
            raise RolloutFiltered(pb.FILTER_REASON_BACKEND_CRASH, str(error)) from error
        finally:
            # Whichever way RUN ends (a cancel included), what the gateway recorded is the result's.
            outcome = self._gateway.close_session(session.key)
            self._keep_samples(rollout, outcome)
            self._on_session_closed(outcome.counters)
        self._judge_harness(rollout, outcome, ended)

    async def _check_sandbox_alive(self, sandbox: AsyncSandbox) -> None:
        """Raises SandboxFailure when the sandbox is no longer running: a harness that failed with
        it is not at fault."""
        state = (await self._client.get_sandbox(sandbox.id)).info.state
        if state != "running":
            raise SandboxFailure(f"sandbox {sandbox.id} is {state}")

    def _keep_samples(self, rollout: Rollout, outcome: GatewayOutcome) -> None:
        samples = list(outcome.samples) or [Trajectory()]
        rollout.trajectory, rollout.extra_samples = samples[0], samples[1:]
        rollout.gateway_counters = outcome.counters

    @staticmethod
    def _judge_harness(rollout: Rollout, outcome: GatewayOutcome, ended: HarnessExit | None) -> None:
        """Sets the finish reason of a harness run, or raises RolloutFiltered."""
        assert rollout.trajectory is not None
        if outcome.llm_unavailable is not None:
            raise RolloutFiltered(pb.FILTER_REASON_LLM_UNREACHABLE, outcome.llm_unavailable)
        if outcome.history_rewritten is not None:
            raise RolloutFiltered(pb.FILTER_REASON_HISTORY_REWRITTEN, outcome.history_rewritten)
        if ended is None:  # RUN's timeout
            reason = FinishReason.TIMEOUT
        elif outcome.context_full:
            reason = FinishReason.CONTEXT_FULL  # the limit ended it, whatever the harness then did
        elif outcome.max_calls_reached:
            reason = FinishReason.MAX_TURNS
        elif ended.succeeded:
            reason = FinishReason.SUBMITTED
        else:
            raise RolloutFiltered(pb.FILTER_REASON_HARNESS_FAILED, ended.describe())
        rollout.trajectory.finish_reason = reason

    async def _eval(self, rollout: Rollout, timeout_s: float) -> None:
        """EVAL: in a clean sandbox with the agent's change (clean_eval.py), or, for a task that opts
        in, in the agent's own sandbox."""
        assert rollout.sandbox is not None
        task = rollout.task
        try:
            async with asyncio.timeout(timeout_s):
                if evaluates_in_place(task):
                    if task.evaluation.commands:
                        rollout.eval_sandbox = pb.EVAL_SANDBOX_IN_PLACE
                    rollout.evaluation = await evaluate(rollout.sandbox, task.evaluation, command_timeout_s=timeout_s)
                else:
                    await self._eval_clean(rollout, timeout_s)
        except TimeoutError:
            raise RolloutFiltered(pb.FILTER_REASON_STAGE_TIMEOUT, f"EVAL ran past its {timeout_s:g} s") from None
        except EvaluationInfraError as error:
            raise RolloutFiltered(pb.FILTER_REASON_EVAL_INFRA, str(error)) from error
        except CorralError as error:
            raise RolloutFiltered(pb.FILTER_REASON_EVAL_INFRA, f"the evaluation failed: {error}") from error

    async def _eval_clean(self, rollout: Rollout, timeout_s: float) -> None:
        """The agent's change is read, then the agent's sandbox is destroyed and the evaluation
        runs in a clean sandbox that takes its place. Where the node has room for one more now, the
        agent's sandbox goes in the background while the clean one starts; else the clean one
        waits for it and takes its room (a rollout never waits for room while it holds some)."""
        assert rollout.sandbox is not None
        if rollout.clean_base is None:
            raise EvaluationInfraError("the set-up sandbox was not recorded for a clean evaluation")

        async def release_agent() -> asyncio.Future[None] | None:
            sandbox, rollout.sandbox = rollout.sandbox, None
            if sandbox is None:
                return None
            if self._room.try_take(1):  # the clean sandbox's; the agent's comes back once it is gone
                return asyncio.shield(self._destroy_later(sandbox, rollout.rollout_id, room=1))
            destroying = asyncio.create_task(self._destroy(sandbox, rollout.rollout_id))
            self._finishing.add(destroying)
            destroying.add_done_callback(self._finishing.discard)
            await asyncio.shield(destroying)
            return None

        def hold(sandbox: AsyncSandbox) -> None:
            rollout.sandbox = sandbox

        rollout.evaluation, rollout.eval_sandbox = await evaluate_clean(
            self._client,
            rollout.sandbox,
            rollout.task,
            rollout.clean_base,
            rollout_id=rollout.rollout_id,
            retries=self._settings.init_retries,
            action_timeout_s=task_limits(rollout.task).action_timeout_s,
            command_timeout_s=timeout_s,
            release_agent=release_agent,
            hold=hold,
            timings=rollout.timings,
        )

    def _check_staleness(self, rollout: Rollout) -> None:
        if not rollout.options.HasField("max_staleness") or rollout.trajectory is None:
            return
        versions = [
            version
            for sample in (rollout.trajectory, *rollout.extra_samples)
            if (version := sample.oldest_weight_version) is not None
        ]
        oldest = min(versions, default=None)
        if oldest is not None and self.policy_version - oldest > rollout.options.max_staleness:
            raise RolloutFiltered(
                pb.FILTER_REASON_STALENESS,
                f"its oldest token is from policy version {oldest}, {self.policy_version - oldest} "
                f"versions behind {self.policy_version} (max_staleness {rollout.options.max_staleness})",
            )

    def _turn_sink(self, rollout: Rollout) -> Callable[[TurnRecord], None] | None:
        if rollout.on_turn is None:
            return None
        sink = rollout.on_turn
        return lambda turn: sink(results.turn_to_proto(turn, rollout.rollout_id))

    # -- ending --------------------------------------------------------------------------------

    def _stop(self, rollout: Rollout, reason: pb.FilterReason | None) -> None:
        """Ends a rollout early: the stage working on it is cancelled (its worker then finishes
        it), or, if it is waiting in a queue, it is finished here."""
        rollout.stop_reason = reason
        if rollout.active is not None:
            rollout.active.cancel()
        elif not rollout.finished:
            if reason is None:
                self._finish(
                    rollout, self._result(rollout, pb.ROLLOUT_STATUS_CANCELLED, error="cancelled by the client")
                )
            else:
                self._finish(rollout, self._filtered(rollout, reason, "the daemon shut down"))

    def _finish(self, rollout: Rollout, result: pb.RolloutResult) -> None:
        """Delivers the result once the sandbox is gone; never twice."""
        if rollout.finished:
            return
        rollout.finished = True
        self._live.pop(rollout.rollout_id, None)
        group = rollout.shared_init
        if group is not None and group.active is not None and not group.waiting():
            # Nobody waits for the shared INIT any more: stop it (its sandboxes are destroyed).
            self._close_membership(group)
            group.active.cancel()
        self._forget_rollout(rollout.rollout_id)
        self.totals[result.status] += 1
        task = asyncio.create_task(self._destroy_then_deliver(rollout, result))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _destroy_then_deliver(self, rollout: Rollout, result: pb.RolloutResult) -> None:
        await self._destroy_sandbox(rollout)
        self._room.give_back(rollout.room)
        rollout.room = 0
        await self._release_clean_base(rollout)
        rollout.timings["total"] = time.monotonic() - rollout.submitted_at
        result.timings.CopyFrom(
            results.stage_timings(
                rollout.timings,
                init_shared_by=rollout.init_shared_by,
                init_fell_back=rollout.init_fell_back,
                eval_sandbox=rollout.eval_sandbox,
            )
        )
        try:
            rollout.deliver(result)
        except Exception:  # noqa: BLE001 - a caller's callback failing must not stop the pipeline
            _log.exception("rollout %s: delivering the result failed", rollout.rollout_id)

    async def _destroy_sandbox(self, rollout: Rollout) -> None:
        sandbox, rollout.sandbox = rollout.sandbox, None
        if sandbox is not None:
            await self._destroy(sandbox, rollout.rollout_id)

    async def _destroy(self, sandbox: AsyncSandbox, owner: str) -> None:
        try:
            await asyncio.wait_for(sandbox.destroy(), DESTROY_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the daemon's reaper removes it later; the rollout must still end
            _log.warning("rollout %s: destroying sandbox %s failed: %s", owner, sandbox.id, error)

    def _destroy_later(self, sandbox: AsyncSandbox, owner: str, *, room: int) -> asyncio.Task[None]:
        """Destroys a sandbox no rollout uses in the background (close() waits for it), then gives
        back its `room`. Returns the task doing it."""

        async def destroy() -> None:
            try:
                await self._destroy(sandbox, owner)
            finally:
                self._room.give_back(room)

        task = asyncio.create_task(destroy())
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)
        return task

    def _result(
        self,
        rollout: Rollout,
        status: pb.RolloutStatus,
        *,
        reason: pb.FilterReason = pb.FILTER_REASON_UNSPECIFIED,
        error: str = "",
    ) -> pb.RolloutResult:
        result = pb.RolloutResult(
            rollout_id=rollout.rollout_id,
            task_id=rollout.task.task_id,
            group_id=rollout.group_id,
            sample_index=rollout.sample_index,
            status=status,
            filter_reason=reason,
            error=error,
            metadata=rollout.task.metadata,
        )
        if rollout.trajectory is not None:
            results.fill_trajectory(result, rollout.trajectory)
        results.fill_gateway(result, rollout.extra_samples, rollout.gateway_counters)
        if rollout.evaluation is not None:
            result.eval_output = rollout.evaluation.output
        return result

    def _filtered(self, rollout: Rollout, reason: pb.FilterReason, error: str) -> pb.RolloutResult:
        return self._result(rollout, pb.ROLLOUT_STATUS_FILTERED, reason=reason, error=error)

    def _completed(self, rollout: Rollout) -> pb.RolloutResult:
        result = self._result(rollout, pb.ROLLOUT_STATUS_COMPLETED)
        assert rollout.evaluation is not None
        result.reward = rollout.evaluation.reward
        return result
