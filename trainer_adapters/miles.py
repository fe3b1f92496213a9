"""Miles adapter: corral rollouts as Miles' custom generate function.

Miles (github.com/radixark/miles; read at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76) calls
the function named by `--custom-generate-function-path` once per sample. Point it here:

    --custom-generate-function-path corral.trainer_adapters.miles.generate          # tools mode
    --custom-generate-function-path corral.trainer_adapters.miles.service_generate  # service mode

Each sample's `metadata["corral_task"]` holds its corral task (a dict in the proto3 JSON mapping,
or JSON text of one); examples/miles/README.md shows the launch lines and converts a tasks JSONL
into Miles' prompt data.

- `generate(input: GenerateFnInput) -> GenerateFnOutput` (Miles' current form; the parameter is
  named `input`, which is how Miles tells it from the legacy form). **Tools mode**: corral's
  rollout pipeline runs in Miles' rollout process (`ToolsModeRollouts`) and generates through
  Miles' SGLang router (`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`, token
  ids in and out); sandboxes come from the node daemon.
- `generate_legacy(args, sample, sampling_params) -> Sample`: the same, in Miles' legacy form.
- `service_generate(input) -> GenerateFnOutput`: **service mode**: the router is registered with
  the daemon's RolloutService once per process (`connect_service`) and the daemon runs the whole
  rollout (`client.rollouts.run`); the daemon's `[rollout] tokenizer` must then be the model's.

All three fill the sample the same way (`fill_sample`):
- `tokens` = the result's prompt_ids + response_ids; `response_length` = len(response_ids);
  `loss_mask` = response_mask (1 on generated tokens, 0 on template and observation tokens);
  `rollout_log_probs` = response_logprobs (0.0 where the mask is 0); `response` = the response
  ids decoded (special tokens kept).
- `weight_versions`: one string per turn (each turn is one engine call, as Miles records them),
  the weight version that generated it.
- `reward`: corral's evaluation reward, so Miles' reward model is not called for these samples
  (do not use `--group-rm`: it would score them again).
- `status`: COMPLETED; TRUNCATED when the agent was cut short (max turns, context full, RUN
  timeout); ABORTED when corral filtered the rollout (an infrastructure failure: sandbox start,
  backend crash, LLM unreachable, evaluation infrastructure, staleness, ...), when an engine
  aborted one of its generations (as Miles' own generate marks a sample whose
  generation finished "abort"), or when Miles aborted the step. ABORTED samples keep
  `reward = None`: Miles skips its reward model for them, and a dynamic filter drops their group
  (`--dynamic-sampling-filter-path
  miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted`; fully async mode drops
  aborted groups by itself). A filtered rollout is never a reward of 0.
- `metadata` gains `corral_rollout_id`, `corral_status`, `corral_finish_reason`,
  `corral_filter_reason` and `corral_error` (the filter's or abort's reason).

Decisions:
- Tokenizer: Miles' own (`input.state.tokenizer`, from `--hf-checkpoint` and
  `--chat-template-path`), since the ids must be the policy's. `--corral-tokenizer byte` selects
  corral's byte-level tokenizer (the built-in reference server's), `--corral-tokenizer DIR` a
  local Hugging Face tokenizer. The legacy form has no state: it takes `--corral-tokenizer`, else
  `args.hf_checkpoint`. The tokenizer is chosen by the first call that needs it (per router and
  daemon) and kept.
- The prompt: the task's own messages. A task without prompt messages takes `sample.prompt`: a
  list of {"role", "content"} messages, or a string that becomes the user message (so do not use
  `--apply-chat-template`: corral applies the chat template itself). It is taken verbatim (braces
  are escaped; the task's prompt fields apply only to its own messages). A task without task_id
  gets `miles-{sample.index}`.
- Sampling: Miles' temperature, top_p and top_k replace the task's (the trainer's loss assumes
  its own sampling), Miles' stop strings are added to the task's. Miles' `max_new_tokens` becomes
  the per-turn limit and `--rollout-max-context-len` the total-token limit only where the task
  sets none (a task's limits are part of the task).
- Policy version and `--corral-max-staleness`: Miles does not tell a generate function the
  current weight version, so the newest weight version the router reports (tools mode: on every
  generation; service mode: in every result) is taken as the policy version that staleness is
  measured against.
- Miles aborting a step (`state.aborted`, set at the end of a step before it aborts the engines'
  requests): the rollout is cancelled within `abort_poll_s`, its sandbox destroyed, and the sample
  comes back ABORTED with no tokens (as Miles' own `reset_for_retry` leaves one).
- Routing: every /generate request carries `X-SMG-Routing-Key: <corral rollout id>`
  (rollout/llm/routing.py; in service mode the daemon's pool sends it), so the router's
  consistent_hashing / manual policies keep a rollout on one engine (prefix cache).

State: `MilesRollouts` holds, per event loop (Miles runs its rollouts in one background loop), one
`ToolsModeRollouts` per (router, daemon address) and one service client per (router, daemon
address): Miles calls generate once per sample, and the pipeline (its stage workers, its daemon
connection) must outlive the call. `DEFAULT_ROLLOUTS` is the module's one instance, which the
module-level functions use; `await DEFAULT_ROLLOUTS.close()` ends what it holds on the running
loop. Nothing else is cached.

Nothing from Miles is imported at module import time (only inside the functions), so this module
imports without Miles installed.

`python -m corral.trainer_adapters.miles TASKS.jsonl -o PROMPT_DATA.jsonl` writes Miles' prompt
data for corral tasks (`prompt_data_row`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from corral.rollout.llm.client import LLMRequestRejected, LLMServerError
from corral.rollout.llm.routing import routed, routed_session
from corral.rollout.llm.sglang import SGLangClient
from corral.rollout.tasks import render_messages
from corral.rollout.tokenizer import chat_tokenizer
from corral.rollout.types import ChatTokenizer, Generation, LLMUnavailable, SamplingOptions
from corral.sdk import AsyncClient, FailedPrecondition, InvalidArgument, RolloutResult
from corral.sdk.tasks import TaskLike, iter_tasks, task_from
from corral.trainer_adapters.common import ToolsModeRollouts, connect_service
from corral.v1 import rollout_pb2 as pb

__all__ = [
    "CORRAL_TASK_KEY",
    "DEFAULT_ROLLOUTS",
    "MilesRollouts",
    "add_arguments",
    "fill_sample",
    "generate",
    "generate_legacy",
    "prompt_data_row",
    "service_generate",
    "task_for_sample",
]

# The key of a sample's metadata that holds its corral task.
CORRAL_TASK_KEY = "corral_task"
# Finish reasons that mean the agent was cut short rather than done.
_TRUNCATING_FINISHES = frozenset({"max_turns", "context_full", "timeout"})


# -- Miles' command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The corral options, added to Miles' parser through `generate.add_arguments` (Miles calls it
    for the function that --custom-generate-function-path names)."""
    options: dict[str, dict[str, Any]] = {
        "--corral-address": dict(
            type=str,
            default=None,
            help="The corral node daemon (default: $CORRAL_ADDRESS / $CORRAL_SOCKET / the system socket).",
        ),
        "--corral-tokenizer": dict(
            type=str,
            default=None,
            help="The chat tokenizer of corral's agent loop. Unset: Miles' own (from --hf-checkpoint); 'byte': "
            "corral's byte-level one (the built-in reference server's); else a local Hugging Face tokenizer "
            "directory.",
        ),
        "--corral-max-staleness": dict(
            type=int,
            default=None,
            help="Abort (as corral filters) a rollout whose oldest generated token is more than this many weight "
            "versions behind the newest the router reported.",
        ),
    }
    for flag, spec in options.items():
        with contextlib.suppress(argparse.ArgumentError):  # already added (the parser was built twice)
            parser.add_argument(flag, **spec)
    return parser


def router_url(args: Any) -> str:
    """Miles' SGLang router: `http://{args.sglang_router_ip}:{args.sglang_router_port}` (Miles
    wraps an IPv6 address in brackets already)."""
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if not ip or not port:
        raise ValueError(
            "args.sglang_router_ip / args.sglang_router_port are not set: Miles sets them once the "
            "rollout servers start (or pass --sglang-router-ip/--sglang-router-port)"
        )
    return f"http://{ip}:{port}"


def _tokenizer_source(args: Any, state: Any) -> Any:
    spec = getattr(args, "corral_tokenizer", None)
    if spec:
        return spec
    tokenizer = getattr(state, "tokenizer", None) if state is not None else None
    if tokenizer is not None:
        return tokenizer
    checkpoint = getattr(args, "hf_checkpoint", None)
    if checkpoint:
        return checkpoint
    raise ValueError("no tokenizer for corral: pass --corral-tokenizer (or run with Miles' --hf-checkpoint)")


# -- sample to task, result to sample -------------------------------------------------------------


def _escape_braces(text: str) -> str:
    """Text that corral's prompt-field substitution gives back unchanged."""
    return text.replace("{", "{{").replace("}", "}}")


def _prompt_messages(prompt: Any) -> list[pb.ChatMessage]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgument("the corral task has no prompt messages and the sample's prompt is empty")
        return [pb.ChatMessage(role="user", content=_escape_braces(prompt))]
    if isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for message in prompt:
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, str) or not isinstance(message.get("role"), str):
                raise InvalidArgument(
                    f"sample prompt message {message!r}: corral takes text messages ({{'role': str, 'content': str}})"
                )
            messages.append(pb.ChatMessage(role=message["role"], content=_escape_braces(content)))
        return messages
    raise InvalidArgument(
        f"the corral task has no prompt messages and the sample's prompt ({type(prompt).__name__}) "
        "is neither text nor a list of messages"
    )


def task_for_sample(sample: Any, sampling_params: Mapping[str, Any] | None = None, args: Any = None) -> pb.Task:
    """The corral task of a Miles sample: `sample.metadata["corral_task"]`, completed from the
    sample (prompt, task id) and from Miles' sampling parameters and args (see the module
    docstring). InvalidArgument when the metadata holds no task."""
    metadata = getattr(sample, "metadata", None) or {}
    raw = metadata.get(CORRAL_TASK_KEY)
    if raw is None:
        raise InvalidArgument(
            f"the sample (index {getattr(sample, 'index', None)}) has no "
            f"metadata[{CORRAL_TASK_KEY!r}]: put each row's corral task under "
            "metadata.corral_task in the prompt data"
        )
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode()
    task = pb.Task()
    task.CopyFrom(task_from(raw))  # a copy: the sample's metadata is never changed
    if not task.task_id:
        task.task_id = f"miles-{getattr(sample, 'index', None)}"
    if not task.prompt.messages:
        task.prompt.messages.extend(_prompt_messages(getattr(sample, "prompt", "")))

    params = dict(sampling_params or {})
    for name in ("temperature", "top_p", "top_k"):
        if params.get(name) is not None:
            setattr(task.sampling, name, params[name])
    stop = params.get("stop")
    for text in [stop] if isinstance(stop, str) else (stop or []):
        if text and text not in task.sampling.stop:
            task.sampling.stop.append(text)
    if not task.limits.max_new_tokens_per_turn and params.get("max_new_tokens"):
        task.limits.max_new_tokens_per_turn = int(params["max_new_tokens"])
    context = getattr(args, "rollout_max_context_len", None)
    if not task.limits.max_total_tokens and context:
        task.limits.max_total_tokens = int(context)
    return task


def fill_sample(
    sample: Any, result: RolloutResult | None, tokenizer: ChatTokenizer | None, *, aborted_reason: str | None = None
) -> Any:
    """Writes a corral result into a Miles sample (in place; returns it); `tokenizer` decodes
    `response`. `result` None: Miles aborted the step before the rollout finished
    (`aborted_reason` says so): the sample comes back ABORTED with no tokens."""
    from miles.utils.types import Sample

    sample.rollout_routed_experts = None  # generation outputs of an earlier attempt do not apply
    sample.rollout_indexer_topk = None
    if result is None:
        sample.tokens, sample.response, sample.response_length = [], "", 0
        sample.loss_mask = sample.rollout_log_probs = None
        sample.weight_versions = []
        sample.reward = None
        sample.status = Sample.Status.ABORTED
        sample.metadata = {
            **(sample.metadata or {}),
            "corral_rollout_id": None,
            "corral_status": "aborted",
            "corral_finish_reason": None,
            "corral_filter_reason": None,
            "corral_error": aborted_reason or "aborted",
        }
        return sample

    if tokenizer is None:
        raise ValueError("fill_sample needs the tokenizer to decode the response")
    sample.tokens = list(result.prompt_ids) + list(result.response_ids)
    sample.response_length = len(result.response_ids)
    sample.loss_mask = list(result.response_mask)
    sample.rollout_log_probs = [float(p) for p in result.response_logprobs]
    sample.response = tokenizer.decode(result.response_ids)
    sample.weight_versions = [str(turn.weight_version) for turn in result.turns]
    if result.status == "completed":
        sample.reward = float(result.reward)
        sample.status = (
            Sample.Status.TRUNCATED if result.finish_reason in _TRUNCATING_FINISHES else Sample.Status.COMPLETED
        )
    else:  # filtered (infrastructure) or cancelled: never a reward
        sample.reward = None
        sample.status = Sample.Status.ABORTED
    sample.metadata = {
        **(sample.metadata or {}),
        "corral_rollout_id": result.rollout_id,
        "corral_status": result.status,
        "corral_finish_reason": result.finish_reason,
        "corral_filter_reason": result.filter_reason,
        "corral_error": result.error or None,
    }
    return sample


# -- the runtime ----------------------------------------------------------------------------------


class _ToolsEngine:
    """Tools mode for one router and daemon: the pipeline and the router's client."""

    def __init__(
        self, url: str, tokenizer: ChatTokenizer, address: str | None, *, timeout_s: float, retries: int
    ) -> None:
        self.session = routed_session()  # Miles' semaphore bounds the samples in flight
        self.llm = SGLangClient(url, session=self.session, timeout_s=timeout_s)
        self.retries = retries
        self.tokenizer = tokenizer
        self.rollouts = ToolsModeRollouts(self.generate, tokenizer, address=address)
        self.policy_version = 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        """GenerateFn for the pipeline: one /generate on the router, retried `retries` times
        (backoff 1 s, doubling) when the failure is the server's; LLMUnavailable after that, and
        LLMRequestRejected at once for a request the router refuses (a 4xx). A generation the
        engine aborted (finish reason "abort": Miles ended the step, or paused generation with
        --pause-generation-mode abort to update weights) is returned as it is: the agent loop
        filters the rollout (LLM_UNREACHABLE), as Miles marks such a sample ABORTED."""
        with routed(rollout_id):
            for attempt in range(self.retries + 1):
                try:
                    generation = await self.llm.generate(prompt_ids, sampling)
                    break
                except LLMServerError as error:
                    if not error.retryable:
                        raise LLMRequestRejected(str(error), server=error.server, status=error.status) from None
                    if attempt == self.retries:
                        raise LLMUnavailable(f"the SGLang router failed {attempt + 1} times: {error}") from None
                    await asyncio.sleep(2.0**attempt)
        if generation.weight_version is not None:
            self.observe_version(generation.weight_version)
        return generation

    def observe_version(self, version: int) -> None:
        if version > self.policy_version:
            self.policy_version = version
            self.rollouts.set_policy_version(version)

    async def close(self) -> None:
        await self.rollouts.close()
        await self.session.close()


@dataclass
class _ServiceEngine:
    """Service mode for one router and daemon: the daemon client with the router registered."""

    client: AsyncClient
    tokenizer: ChatTokenizer
    policy_version: int = 0
    _versions: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def observe(self, result: RolloutResult) -> None:
        versions = [turn.weight_version for turn in result.turns if turn.generated_ids]
        newest = max(versions, default=-1)
        async with self._versions:
            if newest > self.policy_version:
                self.policy_version = newest
                with contextlib.suppress(FailedPrecondition):  # the daemon is ahead already
                    await self.client.rollouts.set_policy_version(newest)

    async def close(self) -> None:
        await self.client.close()


@dataclass
class _LoopEngines:
    """The engines of one event loop, by (mode, router URL, daemon address)."""

    engines: dict[tuple[str, str, str | None], _ToolsEngine | _ServiceEngine] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class MilesRollouts:
    """What the Miles entry points share in one process: per event loop, the tools-mode pipelines
    and service-mode clients (created on first use; see the module docstring).

    `abort_poll_s`: how often a running rollout checks whether Miles aborted the step.
    `llm_retries`: retries of a failed /generate in tools mode.
    """

    def __init__(self, *, abort_poll_s: float = 1.0, llm_retries: int = 2) -> None:
        self.abort_poll_s = abort_poll_s
        self.llm_retries = llm_retries
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopEngines] = weakref.WeakKeyDictionary()

    # -- entry points --

    async def generate(self, input: Any) -> Any:
        """Miles' current form, tools mode."""
        from miles.rollout.base_types import GenerateFnOutput

        sample = await self._generate(input.args, input.state, input.sample, input.sampling_params, service=False)
        return GenerateFnOutput(samples=sample)

    async def generate_legacy(self, args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
        """Miles' legacy form, tools mode (no state: no abort watch; see the module docstring)."""
        return await self._generate(args, None, sample, sampling_params, service=False)

    async def service_generate(self, input: Any) -> Any:
        """Miles' current form, service mode."""
        from miles.rollout.base_types import GenerateFnOutput

        sample = await self._generate(input.args, input.state, input.sample, input.sampling_params, service=True)
        return GenerateFnOutput(samples=sample)

    async def close(self) -> None:
        """Ends the pipelines (unfinished rollouts are filtered, their sandboxes destroyed) and
        closes the clients of the running loop."""
        engines = self._loops.pop(asyncio.get_running_loop(), None)
        for engine in engines.engines.values() if engines is not None else ():
            await engine.close()

    # -- the shared path --

    async def _generate(
        self, args: Any, state: Any, sample: Any, sampling_params: Mapping[str, Any] | None, *, service: bool
    ) -> Any:
        task = task_for_sample(sample, sampling_params, args)
        url = router_url(args)
        address = getattr(args, "corral_address", None)
        max_staleness = getattr(args, "corral_max_staleness", None)
        if _aborted(state):  # Miles ended the step before this sample started
            return fill_sample(sample, None, None, aborted_reason="Miles aborted the rollout step")
        observe: Callable[[RolloutResult], Awaitable[None]] | None = None
        if service:
            service_engine = await self._service_engine(args, state, url, address)
            tokenizer, observe = service_engine.tokenizer, service_engine.observe
            run = service_engine.client.rollouts.run(task, max_staleness=max_staleness)
        else:
            tools_engine = await self._tools_engine(args, state, url, address)
            tokenizer = tools_engine.tokenizer
            run = tools_engine.rollouts.run(task, max_staleness=max_staleness)
        result = await self._unless_aborted(run, state)
        if result is None:
            return fill_sample(sample, None, tokenizer, aborted_reason="Miles aborted the rollout step")
        if observe is not None:
            await observe(result)
        return fill_sample(sample, result, tokenizer)

    async def _unless_aborted(self, run: Any, state: Any) -> RolloutResult | None:
        """The rollout's result, or None when Miles aborts the step first: the rollout is then
        cancelled (tools mode: its sandbox is destroyed before this returns; service mode: the
        daemon destroys it once the call is cancelled). Cancelling this cancels the rollout the
        same way, then re-raises."""
        running = asyncio.ensure_future(run)
        try:
            while True:
                done, _ = await asyncio.wait({running}, timeout=self.abort_poll_s if state is not None else None)
                if done:
                    return running.result()
                if _aborted(state):
                    running.cancel()
                    await asyncio.wait({running})
                    return None
        except asyncio.CancelledError:
            running.cancel()
            await asyncio.wait({running})
            raise

    def _loop_engines(self) -> _LoopEngines:
        loop = asyncio.get_running_loop()
        engines = self._loops.get(loop)
        if engines is None:
            engines = self._loops[loop] = _LoopEngines()
        return engines

    async def _tools_engine(self, args: Any, state: Any, url: str, address: str | None) -> _ToolsEngine:
        held = self._loop_engines()
        key = ("tools", url, address)
        async with held.lock:
            if key not in held.engines:
                timeout = float(getattr(args, "sglang_router_request_timeout_secs", None) or 600.0)
                held.engines[key] = _ToolsEngine(
                    url,
                    chat_tokenizer(_tokenizer_source(args, state)),
                    address,
                    timeout_s=timeout,
                    retries=self.llm_retries,
                )
            engine = held.engines[key]
            assert isinstance(engine, _ToolsEngine)  # the key names the mode
            return engine

    async def _service_engine(self, args: Any, state: Any, url: str, address: str | None) -> _ServiceEngine:
        held = self._loop_engines()
        key = ("service", url, address)
        async with held.lock:
            if key not in held.engines:
                tokenizer = chat_tokenizer(_tokenizer_source(args, state))
                client = await connect_service([url], protocol="sglang", address=address)
                held.engines[key] = _ServiceEngine(client, tokenizer)
            engine = held.engines[key]
            assert isinstance(engine, _ServiceEngine)  # the key names the mode
            return engine


def _aborted(state: Any) -> bool:
    return bool(getattr(state, "aborted", False)) if state is not None else False


# -- the module-level entry points Miles loads ----------------------------------------------------

DEFAULT_ROLLOUTS = MilesRollouts()


async def generate(input: Any) -> Any:
    """--custom-generate-function-path corral.trainer_adapters.miles.generate: tools mode.
    `input` is Miles' GenerateFnInput; returns GenerateFnOutput(samples=sample)."""
    return await DEFAULT_ROLLOUTS.generate(input)


async def generate_legacy(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """Miles' legacy form of `generate` (same conversion): returns the filled Sample."""
    return await DEFAULT_ROLLOUTS.generate_legacy(args, sample, sampling_params)


async def service_generate(input: Any) -> Any:
    """--custom-generate-function-path corral.trainer_adapters.miles.service_generate: service
    mode (the daemon runs the rollout against Miles' router)."""
    return await DEFAULT_ROLLOUTS.service_generate(input)


generate.add_arguments = add_arguments  # type: ignore[attr-defined]
generate_legacy.add_arguments = add_arguments  # type: ignore[attr-defined]
service_generate.add_arguments = add_arguments  # type: ignore[attr-defined]


# -- tasks JSONL to Miles' prompt data ------------------------------------------------------------


def prompt_data_row(task: TaskLike) -> dict[str, Any]:
    """One line of Miles' prompt data (`--prompt-data x.jsonl`, default `--input-key input`,
    `--metadata-key metadata`) for a corral task: "input" is the task's first user message with
    its fields filled in (what Miles logs as the prompt; the rollout uses the task's own messages),
    "metadata.corral_task" the task in the proto3 JSON mapping."""
    task = task_from(task)
    users = [message["content"] for message in render_messages(task) if message["role"] == "user"]
    return {
        "input": users[0] if users else "",
        "metadata": {CORRAL_TASK_KEY: json_format.MessageToDict(task, preserving_proto_field_name=True)},
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m corral.trainer_adapters.miles TASKS.jsonl... -o PROMPT_DATA.jsonl`."""
    parser = argparse.ArgumentParser(
        prog="python -m corral.trainer_adapters.miles",
        description="Convert corral tasks (JSONL) into Miles prompt data (JSONL) whose "
        "rows carry the task under metadata.corral_task.",
    )
    parser.add_argument("tasks", nargs="+", help="corral tasks JSONL files")
    parser.add_argument("-o", "--out", required=True, help="the Miles prompt-data JSONL to write ('-': stdout)")
    options = parser.parse_args(argv)
    rows = []
    for path in options.tasks:
        with open(path, encoding="utf-8") as lines:
            rows += [json.dumps(prompt_data_row(task), ensure_ascii=False) for task in iter_tasks(lines, source=path)]
    text = "".join(row + "\n" for row in rows)
    if options.out == "-":
        sys.stdout.write(text)
    else:
        with open(options.out, "w", encoding="utf-8") as out:
            out.write(text)
    print(f"{len(rows)} tasks -> {options.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
