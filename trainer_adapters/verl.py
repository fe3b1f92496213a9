"""veRL adapter: corral rollouts as veRL agent loops (veRL >= 0.9.1, `pip install 'corral[verl]'`).

Two agent loops, registered with veRL's `register` under these names (and named in
examples/verl/agent_loop.yaml, which veRL's workers load from `agent_loop_config_path`):

- "corral" (`CorralAgentLoop`, tools mode): veRL generates, through the `server_manager` it gives
  every agent loop; corral runs the rest of the rollout in the agent-loop worker (a sandbox from
  the node daemon, the task's setup, tool calls, evaluation). One sandbox per trajectory, always
  destroyed: on success, on a failure, and when veRL cancels the loop.
- "corral_service" (`CorralServiceAgentLoop`, service mode): veRL's inference servers are
  registered with the node daemon, which runs the whole rollout against them.

Each dataset row carries its corral task in `extra_info.corral_task` (a `corral.v1.Task` in the
proto3 JSON mapping, as JSON text or a dict; a top-level `corral_task` column works too). When the
task has no prompt messages, the row's `raw_prompt` is used. examples/verl/make_dataset.py writes
such rows from a tasks JSONL file.

How the output maps onto veRL's `AgentLoopOutput` (`to_agent_loop_output`, shared by both modes):

- prompt_ids / response_ids / response_mask / response_logprobs: corral's token-exact trajectory
  (mask 1 on generated tokens, 0 on template and observation tokens). As veRL's own loops do,
  the response is cut to `rollout.response_length` and a prompt longer than
  `rollout.prompt_length` is cut from the left; the number of tokens cut is reported in
  extra_fields. So that little is cut, the task's `limits.max_total_tokens` is lowered to
  prompt_length + response_length before the rollout starts.
- reward_score: the daemon's evaluation of a completed rollout. A filtered rollout (an
  infrastructure failure: the sandbox did not start, the LLM was unreachable, the evaluation
  could not run, ...) or a cancelled one has no reward: its response_mask is all 0 (none of its
  tokens is trained), extra_fields["corral_filtered"] is True with the reason and error, and
  reward_score is the loop's `filtered_reward`, None unless configured. Note that veRL treats a
  None reward_score as "not scored yet" and hands the row to its reward loop
  (`reward.custom_reward_function`, which sees extra_fields in `extra_info`); set
  `filtered_reward: 0.0` in the YAML entry to give such rows an explicit score instead (their
  tokens stay masked, but group-relative estimators such as GRPO still count the score in the
  group's mean).
- num_turns: counted as veRL's ToolAgentLoop counts them: the prompt, each assistant turn, and
  each tool-response turn.
- metrics: generate_sequences = total LLM time, tool_calls = total tool time (seconds).
- extra_fields: corral_rollout_id, corral_task_id, corral_status, corral_filtered,
  corral_filter_reason, corral_error, corral_finish_reason, corral_format_errors,
  corral_min_weight_version, corral_max_weight_version, corral_truncated_response_tokens,
  corral_truncated_prompt_tokens (the same keys for every row, as veRL's batching wants); in
  tools mode also veRL's own min_global_steps / max_global_steps when its servers report
  global_steps.

Configuration (keys of the YAML entry, passed to the constructor):

- `corral_address`: the node daemon (default: $CORRAL_ADDRESS, $CORRAL_SOCKET, the system socket).
- `corral_tokenizer`: the chat tokenizer corral encodes with. Default: veRL's tokenizer object
  (with `data.apply_chat_template_kwargs`); "byte" or a local tokenizer directory override it.
  It must be the tokenizer of the model that generates.
- `filtered_reward`: the reward_score of filtered and cancelled rollouts (default None, see above).
- Service mode only: `corral_servers` (the servers to register, "host:port" or URLs; default:
  every server veRL's load balancer knows) and `corral_protocol` ("sglang" or "vllm"; default:
  `rollout.name`).

Sampling: veRL's sampling parameters (temperature, top_p, top_k, repetition_penalty, logprobs:
the trainer's, greedy during validation) win over the task's; corral adds the per-turn
`max_tokens` and its stop strings and stop token ids (the chat template's end of turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

try:
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )
except ImportError as _error:  # tests/integration/test_adapter_verl.py hides verl to check this message
    raise ImportError(
        f"corral.trainer_adapters.verl needs veRL (>= 0.9.1): pip install 'corral[verl]' ({_error})"
    ) from _error

from corral.rollout.pipeline import PipelineSettings
from corral.rollout.tasks import DEFAULT_MAX_TOTAL_TOKENS, render_messages
from corral.rollout.tokenizer import HFChatTokenizer, chat_tokenizer
from corral.rollout.types import ChatTokenizer, Generation, LLMUnavailable, SamplingOptions
from corral.sdk import RolloutResult
from corral.sdk.tasks import TaskLike, task_from
from corral.trainer_adapters.common import (
    TOOLS_MODE_SETTINGS,
    ToolsModeRollouts,
    connect_service,
    weight_version_span,
)
from corral.v1 import rollout_pb2 as pb

if TYPE_CHECKING:
    from verl.workers.rollout.replica import TokenOutput

__all__ = [
    "CorralAgentLoop",
    "CorralServiceAgentLoop",
    "service_outputs",
    "task_from_row",
    "to_agent_loop_output",
    "token_output_to_generation",
]

_log = logging.getLogger(__name__)

# One agent-loop instance runs one rollout, so its pipeline needs one worker per stage.
_ONE_ROLLOUT = PipelineSettings(
    init=dataclasses.replace(TOOLS_MODE_SETTINGS.init, workers=1, queue_size=1),
    run=dataclasses.replace(TOOLS_MODE_SETTINGS.run, workers=1, queue_size=1),
    eval=dataclasses.replace(TOOLS_MODE_SETTINGS.eval, workers=1, queue_size=1),
    init_retries=TOOLS_MODE_SETTINGS.init_retries,
)


# -- conversion ---------------------------------------------------------------------------------


def to_agent_loop_output(
    result: RolloutResult,
    response_length: int | None = None,
    *,
    prompt_length: int | None = None,
    filtered_reward: float | None = None,
    logprobs: bool = True,
    placeholder_prompt_ids: Sequence[int] = (),
) -> AgentLoopOutput:
    """A corral RolloutResult as veRL's AgentLoopOutput (see the module docstring).

    `response_length` / `prompt_length`: veRL's rollout.response_length / prompt_length (None: no
    cut). `logprobs`: whether veRL asked for them (sampling_params["logprobs"]); when not,
    response_logprobs is None rather than 0.0s posing as logprobs, and every row of a batch has
    the same. `placeholder_prompt_ids`: the prompt of a rollout that ended before its
    prompt was encoded (a sandbox that did not start), so that veRL never gets an empty sequence.
    """
    completed = result.status == "completed"
    prompt_ids = list(result.prompt_ids) or list(placeholder_prompt_ids)
    cut_prompt = 0
    if prompt_length is not None and len(prompt_ids) > prompt_length:
        cut_prompt = len(prompt_ids) - prompt_length
        prompt_ids = prompt_ids[cut_prompt:]
        _log.warning(
            "corral rollout %s: a prompt of %d tokens is longer than rollout.prompt_length=%d; left-truncated",
            result.rollout_id,
            cut_prompt + prompt_length,
            prompt_length,
        )
    response_ids = list(result.response_ids)
    mask = list(result.response_mask) if completed else [0] * len(response_ids)
    response_logprobs = list(result.response_logprobs) if logprobs else None
    cut_response = 0
    if response_length is not None and len(response_ids) > response_length:
        cut_response = len(response_ids) - response_length
        response_ids, mask = response_ids[:response_length], mask[:response_length]
        if response_logprobs is not None:
            response_logprobs = response_logprobs[:response_length]

    if not completed:
        _log.warning(
            "corral rollout %s of task %s is %s (%s): %s; its tokens are masked out and its reward_score is %s",
            result.rollout_id,
            result.task_id,
            result.status,
            result.filter_reason,
            result.error,
            filtered_reward,
        )
    span = weight_version_span(result)
    metrics = AgentLoopMetrics(
        generate_sequences=sum(turn.llm_time_ms for turn in result.turns) / 1000,
        tool_calls=sum(turn.tool_time_ms for turn in result.turns) / 1000,
    )
    return AgentLoopOutput(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=mask,
        response_logprobs=response_logprobs,
        reward_score=float(result.reward) if completed else filtered_reward,
        num_turns=1 + len(result.turns) + sum(1 for turn in result.turns if turn.observation_ids),
        metrics=metrics,
        extra_fields={
            "corral_rollout_id": result.rollout_id,
            "corral_task_id": result.task_id,
            "corral_status": result.status,
            "corral_filtered": not completed,
            "corral_filter_reason": result.filter_reason,
            "corral_error": result.error,
            "corral_finish_reason": result.finish_reason,
            "corral_format_errors": result.format_errors,
            "corral_min_weight_version": span[0] if span else None,
            "corral_max_weight_version": span[1] if span else None,
            "corral_truncated_response_tokens": cut_response,
            "corral_truncated_prompt_tokens": cut_prompt,
        },
    )


def token_output_to_generation(output: TokenOutput, sampling: SamplingOptions) -> Generation:
    """What veRL's server_manager.generate returned, as a corral Generation.

    - log_probs: veRL's servers return None unless sampling_params["logprobs"] is set
      (`rollout.calculate_log_probs`); corral then records 0.0 per token (see
      `to_agent_loop_output(logprobs=False)`).
    - finish_reason: SGLang passes "stop" / "length" / "abort" through; vLLM reports "completed"
      for both stop and length, and "aborted": "completed" (or no reason) reads as "stop" when the
      last id is a stop id, "length" when max_tokens ids came, else "stop". An aborted call that
      returned nothing raises LLMUnavailable (the rollout is filtered, not blamed on the agent).
    - weight_version: extra_fields["min_global_steps"] (the oldest weights, when a call spanned a
      weight update), else ["global_steps"]; None when veRL reports neither.
    """
    ids = [int(i) for i in output.token_ids]
    reason = output.stop_reason
    if reason in ("aborted", "abort"):
        if not ids:
            raise LLMUnavailable("veRL aborted the generation before any token (a weight update or a shutdown)")
        finish = "abort"
    elif reason in ("stop", "length"):
        finish = reason
    elif ids and ids[-1] in sampling.stop_token_ids:
        finish = "stop"
    else:
        finish = "length" if len(ids) >= sampling.max_new_tokens else "stop"
    logprobs = output.log_probs
    if logprobs is None or len(logprobs) != len(ids):
        logprobs = [0.0] * len(ids)
    extra = output.extra_fields or {}
    version = extra.get("min_global_steps", extra.get("global_steps"))
    if not isinstance(version, int) or isinstance(version, bool):
        version = None
    return Generation(
        output_ids=ids, logprobs=[float(p) for p in logprobs], finish_reason=finish, weight_version=version
    )


# -- shared pieces of both loops ----------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Dataset values as plain Python: numpy arrays (what parquet columns come back as) become
    lists, and None entries of dicts (keys other rows had) are dropped."""
    if isinstance(value, (str, bytes)):
        return value
    if hasattr(value, "tolist") and not isinstance(value, (int, float)):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def task_from_row(row: Mapping[str, Any]) -> pb.Task:
    """The corral task of a veRL dataset row (the kwargs of AgentLoopBase.run): extra_info's
    "corral_task", else a "corral_task" column; the row's raw_prompt when the task has no prompt
    messages."""
    extra_info = row.get("extra_info")
    raw = extra_info.get("corral_task") if isinstance(extra_info, Mapping) else None
    if raw is None:
        raw = row.get("corral_task")
    if raw is None:
        raise ValueError(
            "the dataset row has no corral task: put the task (proto3 JSON text or dict) in "
            "extra_info.corral_task (see examples/verl/make_dataset.py)"
        )
    task = pb.Task()
    task.CopyFrom(task_from(raw if isinstance(raw, (str, pb.Task)) else _plain(raw)))
    if not task.prompt.messages:
        messages = _plain(row.get("raw_prompt")) or []
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
                raise ValueError(f"task {task.task_id}: raw_prompt message {message!r} is not a text chat message")
            task.prompt.messages.add(role=str(message.get("role", "user")), content=message["content"])
    return task


def _fit_task(task: pb.Task, prompt_length: int | None, response_length: int | None) -> None:
    """Lowers the task's max_total_tokens to what veRL keeps (prompt_length + response_length)."""
    if prompt_length is None or response_length is None:
        return
    budget = int(prompt_length) + int(response_length)
    if (task.limits.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS) > budget:
        task.limits.max_total_tokens = budget


def _apply_sampling(task: pb.Task, sampling_params: Mapping[str, Any]) -> None:
    """Service mode: veRL's sampling parameters into the task (they win over the task's)."""
    if sampling_params.get("temperature") is not None:
        task.sampling.temperature = float(sampling_params["temperature"])
    if sampling_params.get("top_p") is not None:
        task.sampling.top_p = float(sampling_params["top_p"])
    top_k = sampling_params.get("top_k")
    if top_k is not None and int(top_k) > 0:
        task.sampling.top_k = int(top_k)


_TOKENIZERS: dict[tuple[int, str], tuple[Any, ChatTokenizer]] = {}


def _chat_tokenizer_for(spec: Any, verl_tokenizer: Any, template_kwargs: Mapping[str, Any]) -> ChatTokenizer:
    """`spec` ("byte" or a local directory) when given, else veRL's tokenizer with its chat-template
    kwargs; wrapping a tokenizer object is cached (it reads the whole vocabulary)."""
    if spec:
        return chat_tokenizer(str(spec))
    key = (id(verl_tokenizer), repr(sorted(dict(template_kwargs).items())))
    cached = _TOKENIZERS.get(key)
    if cached is None or cached[0] is not verl_tokenizer:
        cached = (verl_tokenizer, HFChatTokenizer(verl_tokenizer, template_kwargs=dict(template_kwargs)))
        _TOKENIZERS[key] = cached
    return cached[1]


class _CorralLoop(AgentLoopBase):
    """What both corral agent loops share: configuration, the task from the row, the output."""

    def __init__(
        self,
        *args: Any,
        corral_address: str | None = None,
        corral_tokenizer: str | None = None,
        filtered_reward: float | None = None,
        tools: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.corral_address = corral_address or None
        self.filtered_reward = None if filtered_reward is None else float(filtered_reward)
        self.prompt_length = self.rollout_config.get("prompt_length")
        self.response_length = self.rollout_config.get("response_length")
        self._tokenizer_spec = corral_tokenizer
        self._chat_tokenizer: ChatTokenizer | None = None

    @property
    def chat_tokenizer(self) -> ChatTokenizer:
        if self._chat_tokenizer is None:
            self._chat_tokenizer = _chat_tokenizer_for(
                self._tokenizer_spec, self.tokenizer, self.apply_chat_template_kwargs or {}
            )
        return self._chat_tokenizer

    def _task(self, kwargs: Mapping[str, Any]) -> pb.Task:
        task = task_from_row(kwargs)
        _fit_task(task, self.prompt_length, self.response_length)
        return task

    def _output(self, result: RolloutResult, task: pb.Task, *, logprobs: bool = True) -> AgentLoopOutput:
        placeholder: list[int] = []
        if not result.prompt_ids:  # ended before its prompt was encoded
            placeholder = list(self.chat_tokenizer.encode_prompt(render_messages(task)))
        return to_agent_loop_output(
            result,
            self.response_length,
            prompt_length=self.prompt_length,
            filtered_reward=self.filtered_reward,
            logprobs=logprobs,
            placeholder_prompt_ids=placeholder,
        )


# -- tools mode ---------------------------------------------------------------------------------


@register("corral")
class CorralAgentLoop(_CorralLoop):
    """Tools mode: veRL's server_manager generates, corral runs the rest of the rollout here.

    The generate function corral calls is `server_manager.generate(request_id=<rollout id>,
    prompt_ids=..., sampling_params=<veRL's, with max_tokens, stop, stop_token_ids from corral>)`
    (the rollout id keeps a trajectory on one server, for the prefix cache). A failing call
    filters the rollout (LLM_UNREACHABLE) with the error; it is not blamed on the agent.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sampling_params: dict[str, Any] = {}
        self._generate_kwargs: dict[str, Any] = {}
        self._logprobs_missing = False
        self._versions_missing = False
        self._num_preempted: int | None = None

    async def _generate(self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        params = dict(self._sampling_params)  # the servers pop keys from it
        params.pop("max_new_tokens", None)
        params["max_tokens"] = sampling.max_new_tokens
        if sampling.stop:
            params["stop"] = list(dict.fromkeys([*(params.get("stop") or []), *sampling.stop]))
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(
                dict.fromkeys([*(params.get("stop_token_ids") or []), *sampling.stop_token_ids])
            )
        try:
            output = await self.server_manager.generate(
                request_id=rollout_id, prompt_ids=list(prompt_ids), sampling_params=params, **self._generate_kwargs
            )
        except Exception as error:  # CancelledError is not an Exception: cancellation propagates
            raise LLMUnavailable(f"veRL's server_manager.generate failed: {type(error).__name__}: {error}") from error
        generation = token_output_to_generation(output, sampling)
        if output.log_probs is None or len(output.log_probs) != len(output.token_ids):
            self._logprobs_missing = True
        if generation.weight_version is None:
            self._versions_missing = True
        if output.num_preempted is not None:
            self._num_preempted = (self._num_preempted or 0) + output.num_preempted
        return generation

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = self._task(kwargs)
        self._sampling_params = dict(sampling_params)
        priority = kwargs.get("priority") or 0
        self._generate_kwargs = {"priority": int(priority)} if priority else {}
        uid = kwargs.get("uid")  # veRL's id of the prompt's group of samples
        rollouts = ToolsModeRollouts(
            self._generate, self.chat_tokenizer, address=self.corral_address, settings=_ONE_ROLLOUT
        )
        try:
            result = await rollouts.run(task, group_id=None if uid is None else str(uid))
        finally:
            # Also when veRL cancels the loop: run() has already waited for the sandbox to go.
            await asyncio.shield(rollouts.close())
        wanted = bool(sampling_params.get("logprobs"))
        if wanted and self._logprobs_missing:
            _log.warning(
                "corral rollout %s: veRL's server returned no logprobs for some generations; they read 0.0",
                result.rollout_id,
            )
        output = self._output(result, task, logprobs=wanted)
        if self._num_preempted is not None:
            output.metrics.num_preempted = self._num_preempted
        span = weight_version_span(result)
        if span is not None and not self._versions_missing:  # veRL's global_steps, as its loops report them
            output.extra_fields["min_global_steps"], output.extra_fields["max_global_steps"] = span
        return output


# -- service mode -------------------------------------------------------------------------------


def _server_url(address: str) -> str:
    return address if "://" in address else f"http://{address}"


async def _service_results(
    tasks: Iterable[TaskLike], servers: Iterable[str], *, protocol: str, address: str | None, n: int = 1
) -> AsyncGenerator[RolloutResult, None]:
    client = await connect_service([_server_url(s) for s in servers], protocol=protocol, address=address)
    try:
        async for event in client.rollouts.stream(tasks, n=n):
            if isinstance(event, RolloutResult):
                yield event
    finally:
        await client.close()


async def service_outputs(
    tasks: Iterable[TaskLike],
    servers: Iterable[str],
    *,
    protocol: str = "sglang",
    address: str | None = None,
    n: int = 1,
    response_length: int | None = None,
    prompt_length: int | None = None,
    filtered_reward: float | None = None,
) -> AsyncIterator[tuple[RolloutResult, AgentLoopOutput]]:
    """Service mode from a driver: registers `servers` (veRL's inference servers, e.g. an
    LLMServerManager's server_addresses; "host:port" or URLs) with the daemon, runs `n` rollouts of
    every task there, and yields each result with its AgentLoopOutput as it finishes (completion
    order). Leaving the loop early cancels the unfinished rollouts."""
    async with contextlib.aclosing(
        _service_results(tasks, servers, protocol=protocol, address=address, n=n)
    ) as results:
        async for result in results:
            yield (
                result,
                to_agent_loop_output(
                    result, response_length, prompt_length=prompt_length, filtered_reward=filtered_reward
                ),
            )


@register("corral_service")
class CorralServiceAgentLoop(_CorralLoop):
    """Service mode: the node daemon runs the whole rollout against veRL's own inference servers
    (registered with it on first use; registering again is a no-op). veRL's server_manager is
    not used for generation, so its load balancing and weight-sync pauses do not apply: the
    daemon health-checks the servers itself."""

    def __init__(
        self, *args: Any, corral_servers: Sequence[str] | None = None, corral_protocol: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.corral_servers = [str(s) for s in corral_servers] if corral_servers else None
        self.corral_protocol = str(corral_protocol or self.rollout_config.get("name") or "sglang")

    async def servers(self) -> list[str]:
        """`corral_servers`, else every server veRL's load balancer routes to."""
        if self.corral_servers:
            return self.corral_servers
        balancer = getattr(self.server_manager, "_load_balancer", None)
        if balancer is None:
            raise ValueError("no inference servers to register: set corral_servers in the agent loop's YAML entry")
        return [str(s) for s in await balancer.get_all_servers.remote()]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = self._task(kwargs)
        _apply_sampling(task, sampling_params)
        async with contextlib.aclosing(
            _service_results([task], await self.servers(), protocol=self.corral_protocol, address=self.corral_address)
        ) as results:
            result = await anext(results, None)
        if result is None:
            raise RuntimeError(f"the corral daemon returned no result for task {task.task_id}")
        return self._output(result, task, logprobs=bool(sampling_params.get("logprobs")))
