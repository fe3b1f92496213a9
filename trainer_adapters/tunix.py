"""tunix adapter: corral sandboxes as tunix environments, and corral rollouts as tunix trajectories.

Two ways in, the same two as every adapter (see `corral.trainer_adapters.common`):

- **Environment mode** (tunix keeps the agent loop and generation): `CorralTaskEnv` is a tunix
  `BaseTaskEnv` backed by one corral sandbox per episode. tunix's `TrajectoryCollectEngine` calls
  `reset()` (the sandbox is created and the task set up; the observation is the task's prompt),
  then `step(model reply)` per turn (the reply is parsed as corral tool calls, which run in the
  sandbox through corral's own toolbox; the observation is their output), until the model calls
  submit or `max_steps` is reached; then corral's evaluation gives the reward (in a clean sandbox
  with the agent's change, as the daemon's pipeline evaluates: docs/rollouts.md) and the sandboxes
  are destroyed. `close()` always destroys them.

      learner = with_corral_engine(GRPOLearner)(
          rl_cluster=cluster, algo_config=config, chat_parser=parser,
          env_class=CorralTaskEnv, env_kwargs={"address": "unix:///run/corral/corral.sock"})
      # each dataset example carries {"corral_task": <one line of a corral tasks JSONL file>}

- **Service mode** (the daemon runs whole rollouts against the trainer's inference servers):
  `CorralRolloutSource(tasks, servers=[...])` registers the servers with the daemon, streams
  the tasks' rollouts and yields each finished one as a tunix `TrajectoryItem` whose `traj` is the
  dict `TrajectoryCollectEngine.collect("Token")` returns (what `GRPOLearner._process_results`
  reads), token-exact from corral's result.

Decisions:

- **Sync over async.** tunix calls `reset` / `step` / `close` synchronously, each in a worker thread
  of the default executor (`TrajectoryCollectEngine._run_with_timing`; `step` under
  `asyncio.wait_for` with the episode's remaining time). corral's toolbox and evaluation are
  asyncio code over `AsyncSandbox`. So one process-wide event loop runs in a daemon thread (the
  "bridge"), shared by every environment and holding one `AsyncClient` per daemon address; each
  env method submits a coroutine to it and blocks its worker thread on the result. Envs never
  block each other, and a `close()` arriving while a `step` still runs (tunix's ENV_TIMEOUT path:
  the step's thread is abandoned, then `close()` is called) cancels that step on the bridge and
  destroys the sandbox at once.
- **Infrastructure failures are never a silent reward 0.** A sandbox that cannot be created or set
  up, a sandbox or backend failing under a tool call, an evaluation that cannot be carried out or
  runs past its time: the env frees the sandbox and raises `CorralEnvError` (`reason` is corral's
  filter-reason name: "sandbox_start", "backend_crash", "eval_infra", "stage_timeout"). Under
  tunix's plain `TrajectoryCollectEngine` the error propagates out of `collect` (tunix's
  orchestrator then stops: loud, but it ends the run). `CorralCollectEngine` (plug it in with
  `with_corral_engine(GRPOLearner)`) instead ends such an episode with status
  `TrajectoryStatus.FAILED`, all-zero `conversation_masks` (no token of it is trained on, as tunix
  does for its own overlong filter), `trajectory_reward` 0.0 and the reason under
  `"corral_error"`. tunix cannot drop one member of a GRPO group, so that 0.0 still enters the
  group's reward statistics. A daemon that does not answer at all raises `DaemonNotRunning`, which
  is a configuration error and never turned into FAILED.
- **The prompt.** The first observation is the task's non-system messages (prompt fields filled
  in). tunix's agent has one system prompt for all episodes (`algo_config.system_prompt`), so the
  task's own system message and corral's tool instructions are not sent unless asked:
  `system_prompt(task)` gives that text (put it in the agent's system prompt when it is the same
  for all tasks), or `instructions_in_prompt=True` puts it at the top of the first observation.
- **Observations.** Each step's tool outputs, joined by blank lines, are the observation (tunix's
  agent appends it as a user message); an unusable reply gets corral's format error text instead.
  The final step (submit, `max_steps`, or three unusable replies in a row, as corral's own agent
  loop) returns observation None: its tools ran, but nothing follows it.
- **Service-mode items.** Each task submitted gets group id `first_group_id + k` (an int, as
  tunix's learner numbers groups) and `pair_index` is corral's sample index. Results that are not
  "completed" (filtered: an infrastructure failure; cancelled) are skipped; with
  `keep_filtered=True` they are yielded with status FAILED, zero masks and the reason, so that
  GRPO groups stay complete.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Coroutine, Iterable, Mapping
from typing import Any, TypeAlias

import numpy as np

try:
    from tunix.rl.agentic import utils as tunix_utils
    from tunix.rl.agentic.agents import agent_types
    from tunix.rl.agentic.environments.base_environment import BaseTaskEnv, EnvStepResult
    from tunix.rl.agentic.trajectory.trajectory_collect_engine import TrajectoryCollectEngine
except ImportError as _error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"corral.trainer_adapters.tunix needs tunix, which is not installed: pip install 'corral[tunix]' ({_error})"
    ) from _error

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
from corral.rollout.tasks import check_task, enabled_tools, render_messages, task_limits, tool_call_format
from corral.rollout.tool_calls import ToolCallParseError, parse_tool_calls
from corral.rollout.tools import SandboxToolBox, format_reminder, tool_instructions
from corral.rollout.types import SandboxFailure
from corral.sdk import AsyncClient, AsyncSandbox, CorralError, InvalidArgument, RolloutResult
from corral.sdk.tasks import TaskLike, task_from
from corral.trainer_adapters.common import DaemonNotRunning, connect, connect_service, weight_version_span
from corral.v1 import rollout_pb2 as pb

__all__ = [
    "CorralCollectEngine",
    "CorralEnvError",
    "CorralRolloutSource",
    "CorralTaskEnv",
    "DaemonNotRunning",
    "corral_task_of",
    "system_prompt",
    "task_prompt",
    "token_trajectory",
    "with_corral_engine",
]

_log = logging.getLogger(__name__)

TrajectoryStatus = agent_types.TrajectoryStatus
TrajectoryItem: TypeAlias = agent_types.TrajectoryItem

# Stage timeouts when the task sets none: the daemon's pipeline defaults.
DEFAULT_INIT_TIMEOUT_S = 300.0
DEFAULT_EVAL_TIMEOUT_S = 600.0
DESTROY_TIMEOUT_S = 60.0
# Further sandbox-start attempts after an infrastructure failure, as the daemon's pipeline does.
INIT_RETRIES = 2
# Replies without a usable tool call in a row before the episode ends (corral's agent loop: 3).
MAX_CONSECUTIVE_FORMAT_ERRORS = 3
# The tail of the evaluation output kept in the final step's info.
EVAL_OUTPUT_INFO_CHARS = 4096


class CorralEnvError(RuntimeError):
    """An infrastructure failure (not the model's doing) ended the episode; the sandbox is already
    freed. `reason`: corral's filter-reason name ("sandbox_start", "backend_crash", "eval_infra",
    "stage_timeout", "closed"); `info`: the same as a dict for step infos and trajectories."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.info = {"corral_filter_reason": reason, "corral_error": message}


# -- tasks -----------------------------------------------------------------------------------------


def corral_task_of(value: Any) -> pb.Task:
    """The corral task in a tunix example: `{"corral_task": task}` (or the task itself), where the
    task is a `corral.v1.Task`, a dict in the proto3 JSON mapping, or JSON text (a line of a tasks
    JSONL file). tunix's learner hands each example over as a batch of one (every value a length-1
    array), which is unwrapped. Raises InvalidArgument."""
    value = _single(value)
    if isinstance(value, Mapping) and "corral_task" in value:
        value = _single(value["corral_task"])
    if isinstance(value, bytes):
        value = value.decode()
    if not isinstance(value, (pb.Task, Mapping, str)):
        raise InvalidArgument(
            f"not a corral task: a {type(value).__name__} (expected a corral.v1.Task, a dict in "
            "the proto3 JSON mapping or JSON text, under the example's 'corral_task' key)"
        )
    return task_from(value)


def _single(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise InvalidArgument(f"expected one corral task, got an array of shape {value.shape}")
        return value.reshape(()).item() if value.dtype != object else value.reshape(-1)[0]
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise InvalidArgument(f"expected one corral task, got a sequence of {len(value)}")
        return value[0]
    return value


def system_prompt(task: TaskLike) -> str:
    """The system text corral's own agent loop would send for `task`: its system message(s) and
    the instructions for its tools and tool-call format."""
    task = corral_task_of(task)
    system = [m["content"] for m in render_messages(task) if m["role"] == "system" and m["content"]]
    return "\n\n".join([*system, tool_instructions(enabled_tools(task), tool_call_format(task))])


def task_prompt(task: TaskLike, *, instructions_in_prompt: bool = False) -> str:
    """The first observation of an episode: the task's non-system messages, fields filled in
    (joined by blank lines when there are several), after `system_prompt(task)` if asked."""
    task = corral_task_of(task)
    parts = [m["content"] for m in render_messages(task) if m["role"] != "system" and m["content"]]
    if instructions_in_prompt:
        parts.insert(0, system_prompt(task))
    return "\n\n".join(parts)


# -- the bridge: one event loop thread for every env in the process -------------------------------


class _Bridge:
    """An asyncio event loop in a daemon thread, and the daemon clients that live on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._clients: dict[str, asyncio.Future[AsyncClient]] = {}

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            alive = self._thread is not None and self._thread.is_alive()
            if self._loop is None or not alive or self._pid != os.getpid():  # first use, or a forked child
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="corral-tunix-bridge", daemon=True)
                thread.start()
                self._loop, self._thread, self._pid, self._clients = loop, thread, os.getpid(), {}
            return self._loop

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        loop = self._ensure_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("a CorralTaskEnv method was called from corral's own bridge loop (it would deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    async def client(self, address: str | None) -> AsyncClient:
        """The client of the daemon at `address` (runs on the bridge loop); DaemonNotRunning if it
        does not answer."""
        key = address or ""
        connecting = self._clients.get(key)
        if connecting is None or (connecting.done() and (connecting.cancelled() or connecting.exception())):
            connecting = asyncio.ensure_future(connect(address))
            self._clients[key] = connecting
        return await asyncio.shield(connecting)


_BRIDGE = _Bridge()


# -- environment mode ------------------------------------------------------------------------------


class CorralTaskEnv(BaseTaskEnv):
    """A tunix task environment whose episode runs in a corral sandbox.

    `task`: the tunix example, a dict whose "corral_task" holds the corral task (see
    `corral_task_of`; a bare corral task is wrapped into such a dict). `address`: the node daemon
    (default: $CORRAL_ADDRESS / $CORRAL_SOCKET / the system socket). `max_steps`: model turns
    before the episode ends (default: the task's `limits.max_turns`). `instructions_in_prompt`:
    put `system_prompt(task)` at the top of the first observation. Other keyword arguments (tunix's
    learner passes `group_id` and `pair_index`) are kept in `extra_kwargs`.

    The reward is the corral task's evaluation, given on the final step (0.0 before); `reward_fn`
    is not used. After the final step `last_result` holds the finish reason, reward and evaluation
    output. Infrastructure failures raise `CorralEnvError` (see the module docstring).
    """

    def __init__(
        self,
        task: Any = None,
        *,
        address: str | None = None,
        max_steps: int | None = None,
        instructions_in_prompt: bool = False,
        **kwargs: Any,
    ) -> None:
        if task is not None and not isinstance(task, dict):
            task = {"corral_task": task}
        super().__init__(task, max_steps=1, **kwargs)
        self.corral_task = corral_task_of(self.task)
        check_task(self.corral_task)  # TaskError (a ValueError): the task cannot run as written
        self.limits = task_limits(self.corral_task)
        self.max_steps = max_steps if max_steps is not None else self.limits.max_turns
        self.address = address
        self.prompt = task_prompt(self.corral_task, instructions_in_prompt=instructions_in_prompt)
        self.last_result: dict[str, Any] | None = None
        self._format = tool_call_format(self.corral_task)
        # Touched only on the bridge loop.
        self._sandbox: AsyncSandbox | None = None
        self._toolbox: SandboxToolBox | None = None
        # The set-up sandbox recorded for the clean evaluation (clean_eval.py).
        self._clean_base: CleanBase | None = None
        self._client: AsyncClient | None = None
        self._active: asyncio.Task | None = None
        self._format_errors = 0
        self._used = False
        self._rollout_id = ""

    @property
    def sandbox_id(self) -> str | None:
        """The id of the episode's sandbox while it exists."""
        sandbox = self._sandbox
        return sandbox.id if sandbox is not None else None

    # -- tunix's template methods (called in tunix's worker threads) ----------------------------

    def _initial_observation(self) -> str:
        self._call(self._start(), "reset")
        return self.prompt

    def _step_impl(self, action: Any) -> EnvStepResult:
        last = self.step_count >= self.max_steps  # BaseTaskEnv.step counted this step already
        return self._call(self._step(_action_text(action), last), "step")

    def close(self) -> None:
        """Destroys the episode's sandbox (cancelling a step still running); safe to call again."""
        if not self._used:
            return
        try:
            _BRIDGE.submit(self._close()).result(timeout=DESTROY_TIMEOUT_S + 30)
        except Exception as error:  # noqa: BLE001 - the daemon's idle reaper removes what could not be destroyed now
            _log.warning("closing the corral environment of task %s failed: %s", self.corral_task.task_id, error)

    # -- on the bridge loop ----------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any], what: str) -> Any:
        self._used = True
        future = _BRIDGE.submit(self._guarded(coro))
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise CorralEnvError("closed", f"{what} was interrupted: the environment was closed") from None

    async def _guarded(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.current_task()
        self._active = task
        try:
            return await coro
        finally:
            if self._active is task:
                self._active = None

    async def _close(self) -> None:
        active = self._active
        if active is not None and active is not asyncio.current_task():
            active.cancel()
            await asyncio.wait({active})
        await self._release()

    async def _release(self) -> None:
        """Destroys the sandbox (its shell and kernel go with it) and the clean evaluation's
        snapshot."""
        await self._destroy_sandbox()
        base, self._clean_base = self._clean_base, None
        if base is not None and self._client is not None:
            await release_clean_base(self._client, base)

    async def _destroy_sandbox(self) -> None:
        sandbox, self._sandbox, self._toolbox = self._sandbox, None, None
        if sandbox is None:
            return
        try:
            await asyncio.wait_for(sandbox.destroy(), DESTROY_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the daemon's idle reaper removes it later
            _log.warning("destroying sandbox %s failed: %s", sandbox.id, error)

    async def _start(self) -> None:
        await self._release()  # a previous episode's
        self._format_errors = 0
        self.last_result = None
        client = await _BRIDGE.client(self.address)  # DaemonNotRunning propagates: a configuration error
        self._client = client
        timeout_s = self.limits.init_timeout_s or DEFAULT_INIT_TIMEOUT_S
        extra = self.extra_kwargs
        rollout_id = f"tunix/{extra.get('group_id', '-')}/{extra.get('pair_index', '-')}/{secrets.token_hex(4)}"
        try:
            async with asyncio.timeout(timeout_s):
                self._sandbox = await start_task_sandbox(
                    client,
                    self.corral_task,
                    rollout_id=rollout_id,
                    retries=INIT_RETRIES,
                    action_timeout_s=self.limits.action_timeout_s,
                )
                self._rollout_id = rollout_id
                if not evaluates_in_place(self.corral_task):
                    self._clean_base, _ = await record_clean_base(
                        client, self._sandbox, [self.corral_task], snapshot=True
                    )
                    self._clean_base.holders = 1
        except (SandboxStartFailed, CleanBaseFailed) as error:
            await self._release()
            raise CorralEnvError("sandbox_start", str(error)) from error
        except TimeoutError:
            raise CorralEnvError(
                "stage_timeout", f"creating and setting up the sandbox ran past {timeout_s:g} s"
            ) from None
        self._toolbox = SandboxToolBox(
            self._sandbox,
            enabled_tools(self.corral_task),
            workdir=self._sandbox.info.workdir,
            max_observation_bytes=self.limits.max_observation_bytes,
        )

    async def _step(self, text: str, last: bool) -> EnvStepResult:
        if self._toolbox is None:
            raise RuntimeError(
                "step() without a running episode: call reset() first (the episode ended, "
                "or the environment was closed)"
            )
        calls, error = [], None
        try:
            calls = parse_tool_calls(text, self._format)
        except ToolCallParseError as parse_error:
            error = f"Error: your tool call could not be read: {parse_error}. {format_reminder(self._format)}"
        if not calls and error is None:
            error = f"Error: your reply has no tool call. {format_reminder(self._format)}"
        observations: list[str] = []
        submitted = False
        try:
            for call in calls:
                result = await self._toolbox.call(call, self.limits.action_timeout_s)
                if result.submitted:
                    submitted = True
                    break  # calls after submit do not run
                observations.append(result.text)
        except (SandboxFailure, CorralError) as failure:
            await self._release()
            raise CorralEnvError("backend_crash", str(failure)) from failure
        self._format_errors = self._format_errors + 1 if error is not None else 0
        info: dict[str, Any] = {
            "tool_calls": [call.name for call in calls],
            "format_error": error is not None,
            "sandbox_id": self.sandbox_id,
        }
        finish = (
            "submitted"
            if submitted
            else "unparsable"
            if self._format_errors >= MAX_CONSECUTIVE_FORMAT_ERRORS
            else "max_turns"
            if last
            else None
        )
        if finish is None:
            return EnvStepResult(
                observation=error if error is not None else "\n\n".join(observations), reward=0.0, done=False, info=info
            )
        evaluation = await self._evaluate()
        self.last_result = {
            "finish_reason": finish,
            "reward": evaluation.reward,
            "eval_output": evaluation.output.decode(errors="replace")[-EVAL_OUTPUT_INFO_CHARS:],
        }
        info.update(self.last_result)
        return EnvStepResult(observation=None, reward=evaluation.reward, done=True, info=info)

    async def _evaluate(self) -> Evaluation:
        """In a clean sandbox with the agent's change (the agent's own is destroyed first), or in
        the agent's sandbox for a task that opts in (docs/rollouts.md)."""
        assert self._sandbox is not None
        timeout_s = self.limits.eval_timeout_s or DEFAULT_EVAL_TIMEOUT_S
        try:
            async with asyncio.timeout(timeout_s):
                if evaluates_in_place(self.corral_task):
                    return await evaluate(self._sandbox, self.corral_task.evaluation, command_timeout_s=timeout_s)
                if self._clean_base is None or self._client is None:
                    raise EvaluationInfraError("the set-up sandbox was not recorded for a clean evaluation")

                def hold(sandbox: AsyncSandbox) -> None:
                    self._sandbox = sandbox

                evaluation, _ = await evaluate_clean(
                    self._client,
                    self._sandbox,
                    self.corral_task,
                    self._clean_base,
                    rollout_id=self._rollout_id,
                    retries=INIT_RETRIES,
                    action_timeout_s=self.limits.action_timeout_s,
                    command_timeout_s=timeout_s,
                    release_agent=self._destroy_sandbox,
                    hold=hold,
                    timings={},
                )
                return evaluation
        except TimeoutError:
            raise CorralEnvError("stage_timeout", f"the evaluation ran past {timeout_s:g} s") from None
        except EvaluationInfraError as error:
            raise CorralEnvError("eval_infra", str(error)) from error
        except CorralError as error:
            raise CorralEnvError("eval_infra", f"the evaluation failed: {error}") from error
        finally:
            await self._release()


def _action_text(action: Any) -> str:
    """The model's reply in what tunix passes to `step`: an Action, the text, or None / [] (the
    engine's fallback when the agent gave no action)."""
    if isinstance(action, agent_types.Action):
        action = action.action
    if action is None or (isinstance(action, (list, tuple)) and not action):
        return ""
    return action if isinstance(action, str) else str(action)


class CorralCollectEngine(TrajectoryCollectEngine):
    """tunix's TrajectoryCollectEngine, for CorralTaskEnv: an episode that a `CorralEnvError` ends
    (sandbox start, backend crash, evaluation infrastructure) is returned as a trajectory with
    status FAILED instead of raising out of `collect`; in "Token" mode its `conversation_masks` are
    all zero, its `trajectory_reward` is 0.0 and `"corral_error"` holds the reason. In
    "Trajectory" mode the trajectory carries the same dict as `.corral_error`.

    Use it as `RolloutOrchestrator(engine_cls=CorralCollectEngine, ...)`, or through
    `with_corral_engine(learner_cls)`. Overrides tunix 0.1.7's `_reset` and `_one_step`.
    """

    corral_error: CorralEnvError | None = None

    async def collect(self, mode: str = "Conversation") -> Any:
        self.corral_error = None
        result = await super().collect(mode)
        if self.corral_error is None:
            return result
        if mode == "Token":
            result["conversation_masks"] = np.zeros_like(result["conversation_masks"])
            result["trajectory_reward"] = 0.0
            result["corral_error"] = dict(self.corral_error.info)
        elif mode == "Trajectory":
            result.corral_error = dict(self.corral_error.info)
        return result

    async def _reset(self) -> None:
        try:
            await super()._reset()
        except CorralEnvError as error:
            # The episode never started; the agent still gets the prompt, so that the trajectory
            # has its task and prompt tokens like any other.
            self.corral_error = error
            self.agent.reset()
            self.agent.update_from_env(
                observation=getattr(self.env, "prompt", None), reward=0.0, done=False, info=dict(error.info)
            )
            if self.tokenizer is not None and self.chat_parser is not None:
                prompt_tokens, _ = tunix_utils.tokenize_and_generate_masks(
                    self.agent.chat_completions,
                    tokenizer=self.tokenizer,
                    parser=self.chat_parser,
                    contains_first_msg=True,
                    contains_generation_msg=True,
                )
                self.agent.trajectory.prompt_tokens = prompt_tokens
            self._start_ts = time.perf_counter()
            self._response_token_count = 0

    async def _one_step(self) -> bool:
        if self.corral_error is None:
            try:
                return await super()._one_step()
            except CorralEnvError as error:
                self.corral_error = error
                step = self.agent.get_current_step()
                if step is not None:
                    step.done = True
                    step.info = dict(error.info)
        self.agent.trajectory.status = TrajectoryStatus.FAILED
        return True


def with_corral_engine(learner_cls: type) -> type:
    """A subclass of a tunix agentic learner (e.g. `GRPOLearner`) whose rollout orchestrator runs
    `CorralCollectEngine` (tunix 0.1.7's `AgenticRLLearner._build_orchestrator` hard-codes
    `TrajectoryCollectEngine`)."""

    class CorralLearner(learner_cls):
        def _build_orchestrator(self):
            orchestrator = super()._build_orchestrator()
            orchestrator.engine_cls = CorralCollectEngine
            return orchestrator

    CorralLearner.__name__ = CorralLearner.__qualname__ = f"Corral{learner_cls.__name__}"
    CorralLearner.__module__ = __name__
    return CorralLearner


# -- service mode ----------------------------------------------------------------------------------

# corral finish reason -> tunix trajectory status, for completed results.
_STATUS_BY_FINISH = {
    "submitted": TrajectoryStatus.SUCCEEDED,
    "unparsable": TrajectoryStatus.SUCCEEDED,  # ended by the model's own replies; the reward stands
    "max_turns": TrajectoryStatus.MAX_STEPS_REACHED,
    "context_full": TrajectoryStatus.MAX_CONTEXT_LIMIT_REACHED,
    "timeout": TrajectoryStatus.TIMEOUT,
}


def token_trajectory(
    result: RolloutResult, *, group_id: Any = None, original_input: Any = None, policy_version: int = 0
) -> dict[str, Any]:
    """A corral rollout result as the dict tunix's `TrajectoryCollectEngine.collect("Token")`
    returns: prompt_tokens, conversation_tokens (corral's response ids: generated tokens and
    observations), conversation_masks (1 generated / 0 observation), old_logprobs (0.0 on
    observations), trajectory_reward, policy_version (the oldest weight version that generated a
    token; `policy_version` when none did), status (a TrajectoryStatus name), group_id,
    conversation_text, env_time, reward_time, original_input; plus corral's own fields under
    "corral_*". A result that is not "completed" gets status FAILED, zero masks and reward 0.0.
    """
    completed = result.status == "completed"
    masks = np.asarray(result.response_mask, dtype=np.int32)
    span = weight_version_span(result)
    timings = dict(result.timings)
    if completed:
        status = _STATUS_BY_FINISH.get(result.finish_reason or "", TrajectoryStatus.SUCCEEDED)
    else:
        status = TrajectoryStatus.FAILED
    return {
        "conversation_text": [dict(message) for message in result.messages],
        "prompt_tokens": np.asarray(result.prompt_ids, dtype=np.int32),
        "conversation_tokens": np.asarray(result.response_ids, dtype=np.int32),
        "conversation_masks": masks if completed else np.zeros_like(masks),
        "status": status.name,
        "trajectory_reward": float(result.reward) if completed else 0.0,
        "env_time": {
            "reset_latency": timings.get("init", 0.0),
            "reset_cpu_time": 0.0,
            "step_latency": sum(turn.tool_time_ms for turn in result.turns) / 1000,
            "step_cpu_time": 0.0,
        },
        "reward_time": {"reward_latency": timings.get("eval", 0.0), "reward_cpu_time": 0.0},
        "old_logprobs": np.asarray(result.response_logprobs, dtype=np.float32),
        "policy_version": span[0] if span is not None else policy_version,
        "original_input": original_input,
        "group_id": group_id,
        "corral_rollout_id": result.rollout_id,
        "corral_task_id": result.task_id,
        "corral_status": result.status,
        "corral_finish_reason": result.finish_reason,
        "corral_filter_reason": result.filter_reason,
        "corral_error": result.error,
        "corral_weight_versions": span,
        "corral_timings": timings,
    }


class CorralRolloutSource:
    """Service mode: rollouts of `tasks` run by the daemon against the trainer's inference servers,
    as tunix `TrajectoryItem`s in completion order.

        source = CorralRolloutSource(dataset, servers=["http://10.0.0.5:30000"], n=4)
        async for item in source:   # item.traj: a collect("Token") dict
            ...

    `tasks`: corral tasks (messages, proto3-JSON dicts or JSON text) or tunix examples carrying one
    under "corral_task", from a list, a generator or an async generator; submitting goes on while
    results arrive (the daemon's queues pace it). `servers` are registered with the daemon
    (`protocol` "sglang" or "vllm"; servers registered already are kept, and stay registered
    afterwards). `n` samples per task; `max_staleness` as in corral's RolloutOptions;
    `policy_version` is sent to the daemon first (when given) and stands in for results with no
    generated token. Task k (from 0) gets group id `first_group_id + k`; `pair_index` is the sample
    index. Results that did not complete are skipped, or with `keep_filtered` yielded as FAILED
    with zero masks. Each item's metadata holds corral's `RolloutResult` under "corral_result".
    Leaving the loop early cancels the unfinished rollouts (their sandboxes are freed).
    """

    def __init__(
        self,
        tasks: Iterable[Any] | AsyncIterable[Any],
        *,
        servers: Iterable[str] = (),
        protocol: str = "sglang",
        address: str | None = None,
        n: int = 1,
        max_staleness: int | None = None,
        policy_version: int | None = None,
        first_group_id: int = 0,
        keep_filtered: bool = False,
    ) -> None:
        self._tasks = tasks
        self._servers = list(servers)
        self._protocol = protocol
        self._address = address
        self._n = n
        self._max_staleness = max_staleness
        self._policy_version = policy_version
        self._first_group_id = first_group_id
        self._keep_filtered = keep_filtered
        # Results skipped so far (not completed, and `keep_filtered` is off).
        self.skipped = 0

    def __aiter__(self) -> AsyncIterator[TrajectoryItem]:
        return self._items()

    async def _items(self) -> AsyncIterator[TrajectoryItem]:
        client = await connect_service(
            self._servers, protocol=self._protocol, address=self._address, policy_version=self._policy_version
        )
        # group id -> [the task as given, results still to come]
        pending: dict[str, list[Any]] = {}
        try:
            async with client.rollouts.open_stream() as stream:

                async def submit_all() -> None:
                    try:
                        group = self._first_group_id
                        async for given in _aiter(self._tasks):
                            task = corral_task_of(given)
                            pending[str(group)] = [given, self._n]
                            await stream.submit(task, n=self._n, max_staleness=self._max_staleness, group_id=str(group))
                            group += 1
                    finally:
                        await stream.close_input()

                submitter = asyncio.create_task(submit_all())
                try:
                    async for event in stream:
                        if isinstance(event, RolloutResult):
                            item = self._item(event, pending)
                            if item is not None:
                                yield item
                    await submitter
                finally:
                    submitter.cancel()
                    with contextlib.suppress(BaseException):
                        await submitter
        finally:
            await client.close()

    def _item(self, result: RolloutResult, pending: dict[str, list[Any]]) -> TrajectoryItem | None:
        entry = pending.get(result.group_id)
        original = entry[0] if entry is not None else None
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del pending[result.group_id]
        if result.status != "completed" and not self._keep_filtered:
            self.skipped += 1
            _log.info(
                "skipping rollout %s (%s, %s): %s", result.rollout_id, result.status, result.filter_reason, result.error
            )
            return None
        group_id: Any = int(result.group_id) if result.group_id.lstrip("-").isdigit() else result.group_id
        traj = token_trajectory(
            result, group_id=group_id, original_input=original, policy_version=self._policy_version or 0
        )
        return TrajectoryItem(
            pair_index=result.sample_index,
            group_id=group_id,
            start_step=0,
            traj=traj,
            metadata={"corral_result": result, "rollout_id": result.rollout_id, "task_id": result.task_id},
        )


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
