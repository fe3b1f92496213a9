"""Tasks: checking them, and the values they leave unset.

A task is a `corral.v1.Task` message; tasks files hold one per line in the proto3 JSON mapping
(`corral.sdk.tasks` reads them), so the file format and the wire format cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.rollout.change import check_change
from corral.rollout.prompt import MissingPromptField, fill_prompt_fields
from corral.rollout.tool_calls import ToolCallFormat
from corral.rollout.types import SamplingOptions, ToolName
from corral.sdk.errors import InvalidArgument
from corral.v1 import rollout_pb2 as pb

DEFAULT_TOOLS = ("bash", "editor", "submit")
KNOWN_TOOLS = frozenset(tool.value for tool in ToolName)
KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool"})

DEFAULT_MAX_TURNS = 30
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_MAX_TOTAL_TOKENS = 32768
DEFAULT_ACTION_TIMEOUT_S = 60.0
DEFAULT_MAX_OBSERVATION_BYTES = 8192


class TaskError(InvalidArgument, ValueError):
    """A task that cannot run as written (the caller's mistake: INVALID_ARGUMENT)."""


def check_task(task: pb.Task) -> None:
    """Raises TaskError when the task cannot run as written."""
    if not task.task_id:
        raise TaskError("task_id is required")
    if not task.prompt.messages:
        raise TaskError(f"task {task.task_id}: the prompt has no messages")
    for message in task.prompt.messages:
        if message.role not in KNOWN_ROLES:
            raise TaskError(f"task {task.task_id}: unknown message role {message.role!r}")
    unknown = set(task.tools) - KNOWN_TOOLS
    if unknown:
        raise TaskError(f"task {task.task_id}: unknown tools {sorted(unknown)} (known: {sorted(KNOWN_TOOLS)})")
    if tool_call_format(task) is ToolCallFormat.FENCED_BASH and set(enabled_tools(task)) - {"bash", "submit"}:
        raise TaskError(f"task {task.task_id}: the fenced-bash format can only call bash and submit")
    if task.evaluation.commands and task.evaluation.WhichOneof("reward") is None:
        raise TaskError(f"task {task.task_id}: evaluation commands need a reward rule")
    if task.evaluation.WhichOneof("reward") is not None and not task.evaluation.commands:
        raise TaskError(f"task {task.task_id}: a reward rule needs evaluation commands")
    try:
        render_messages(task)
    except MissingPromptField as error:
        raise TaskError(f"task {task.task_id}: {error.args[0]}") from None
    if task.HasField("harness"):
        _check_harness(task.task_id, task.harness)
    if task.evaluation.isolation not in pb.EvaluationIsolation.values():
        raise TaskError(f"task {task.task_id}: unknown evaluation.isolation {task.evaluation.isolation}")
    problem = check_change(task.evaluation.change)
    if problem is not None:
        raise TaskError(f"task {task.task_id}: {problem}")


def _check_harness(task_id: str, harness: pb.TaskHarness) -> None:
    if not harness.command or not harness.command[0]:
        raise TaskError(f"task {task_id}: harness.command is empty (it is the argv to run)")
    if any("\0" in arg for arg in harness.command):
        raise TaskError(f"task {task_id}: harness.command holds a NUL byte")
    if harness.place not in pb.HarnessPlace.values():
        raise TaskError(f"task {task_id}: unknown harness.place {harness.place}")
    if harness.history_policy not in pb.HistoryPolicy.values():
        raise TaskError(f"task {task_id}: unknown harness.history_policy {harness.history_policy}")
    for name, value in harness.env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise TaskError(f"task {task_id}: harness.env has an unusable variable {name!r}")
    if harness.workdir and not harness.workdir.startswith("/"):
        raise TaskError(f"task {task_id}: harness.workdir must be an absolute path, got {harness.workdir!r}")


def is_harness_task(task: pb.Task) -> bool:
    return task.HasField("harness")


def runs_on_host(task: pb.Task) -> bool:
    """Whether a harness task's command runs on the node, outside the sandbox."""
    return is_harness_task(task) and task.harness.place != pb.HARNESS_PLACE_SANDBOX


def task_prompt_text(task: pb.Task) -> str:
    """The prompt's last user message with the fields filled in (a harness's CORRAL_TASK_PROMPT)."""
    users = [m["content"] for m in render_messages(task) if m["role"] == "user"]
    return users[-1] if users else ""


def render_messages(task: pb.Task) -> list[dict[str, str]]:
    """The prompt messages with the task's fields filled in."""
    return [
        {"role": m.role, "content": fill_prompt_fields(m.content, task.prompt.fields)} for m in task.prompt.messages
    ]


def enabled_tools(task: pb.Task) -> tuple[str, ...]:
    return tuple(task.tools) or DEFAULT_TOOLS


def tool_call_format(task: pb.Task) -> ToolCallFormat:
    if task.tool_call_format == pb.TOOL_CALL_FORMAT_FENCED_BASH:
        return ToolCallFormat.FENCED_BASH
    return ToolCallFormat.HERMES


@dataclass(frozen=True)
class TaskLimits:
    """A task's limits with the defaults filled in."""

    max_turns: int
    max_new_tokens_per_turn: int
    max_total_tokens: int
    action_timeout_s: float
    max_observation_bytes: int
    # None: the daemon's default for the stage.
    init_timeout_s: float | None
    run_timeout_s: float | None
    eval_timeout_s: float | None


def task_limits(task: pb.Task) -> TaskLimits:
    limits = task.limits

    def seconds(ms: int) -> float | None:
        return ms / 1000 if ms else None

    return TaskLimits(
        max_turns=limits.max_turns or DEFAULT_MAX_TURNS,
        max_new_tokens_per_turn=limits.max_new_tokens_per_turn or DEFAULT_MAX_NEW_TOKENS,
        max_total_tokens=limits.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS,
        action_timeout_s=seconds(limits.action_timeout_ms) or DEFAULT_ACTION_TIMEOUT_S,
        max_observation_bytes=limits.max_observation_bytes or DEFAULT_MAX_OBSERVATION_BYTES,
        init_timeout_s=seconds(limits.init_timeout_ms),
        run_timeout_s=seconds(limits.run_timeout_ms),
        eval_timeout_s=seconds(limits.eval_timeout_ms),
    )


def sampling_options(task: pb.Task, max_new_tokens: int) -> SamplingOptions:
    sampling = task.sampling
    return SamplingOptions(
        max_new_tokens=max_new_tokens,
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        top_k=sampling.top_k if sampling.HasField("top_k") else -1,
        stop=tuple(sampling.stop),
    )
