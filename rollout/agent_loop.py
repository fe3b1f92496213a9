"""The token-in/token-out agent loop: generate, parse tool calls, run them, append the observation.

Token exactness is the point: the LLM server gets ids and returns ids; the loop appends exactly
those ids (mask 1, with their logprobs and weight version) and then the ids the tokenizer gives for
what follows them (mask 0), so the trajectory a trainer sees is the sequence the model was really
conditioned on, never a re-tokenization of the chat.

Decisions:
- The final turn of an episode that ends by itself (SUBMITTED, MAX_TURNS, CONTEXT_FULL, UNPARSABLE)
  gets no observation: its tool calls ran (their effects count for evaluation) but the trajectory
  and `messages` end with its generated ids / assistant message. Appending tokens no model will
  ever read would only cost sequence length, and for CONTEXT_FULL would break max_total_tokens.
- Turns are appended whole, after their tools ran, with no await in between: a caller that
  cancels `run` (a RUN timeout) keeps a consistent trajectory of the complete turns, and sets
  finish_reason TIMEOUT itself.
- Priority when several endings apply to one turn: SUBMITTED, CONTEXT_FULL, UNPARSABLE, MAX_TURNS
  (a reply cut short by the context is the context's fault, not a format error's).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from corral.rollout.tool_calls import ToolCallFormat, ToolCallParseError, parse_tool_calls
from corral.rollout.tools import format_reminder, tool_instructions
from corral.rollout.types import (
    ChatTokenizer,
    FinishReason,
    GenerateFn,
    LLMUnavailable,
    SamplingOptions,
    ToolBox,
    ToolCall,
    Trajectory,
    TurnRecord,
)


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int
    max_new_tokens_per_turn: int
    # Prompt plus response tokens of the whole trajectory.
    max_total_tokens: int
    # One tool call.
    action_timeout_s: float
    # Replies without a usable tool call in a row before the episode ends as UNPARSABLE.
    max_consecutive_format_errors: int = 3


class AgentLoop:
    """One rollout's agent loop. `self.trajectory` is built in place while `run` runs.

    `sampling.max_new_tokens` is replaced on each turn by min(max_new_tokens_per_turn, room left
    under max_total_tokens), where max_total_tokens is the smaller of the limit and the context
    window `context_length()` reports (the LLM servers' max_model_len), and the tokenizer's end-of-turn ids are added to its stop ids.
    `policy_version()` is the weight version of generations whose server reports none.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        generate: GenerateFn,
        tools: ToolBox,
        *,
        limits: AgentLimits,
        tool_call_format: ToolCallFormat,
        sampling: SamplingOptions,
        rollout_id: str,
        policy_version: Callable[[], int],
        on_turn: Callable[[TurnRecord], None] | None = None,
        context_length: Callable[[], Awaitable[int | None]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.generate = generate
        self.tools = tools
        self.limits = limits
        self.tool_call_format = tool_call_format
        self.sampling = sampling
        self.rollout_id = rollout_id
        self.policy_version = policy_version
        self.on_turn = on_turn
        self.context_length = context_length
        self.trajectory = Trajectory()

    async def run(self, messages: Sequence[dict[str, str]]) -> Trajectory:
        """Runs the episode from `messages` (the task's prompt) and returns `self.trajectory`.
        LLMUnavailable and SandboxFailure propagate."""
        trajectory = self.trajectory
        trajectory.messages = self._with_instructions(messages)
        trajectory.prompt_ids = list(self.tokenizer.encode_prompt(trajectory.messages))
        stop_ids = tuple(dict.fromkeys((*self.sampling.stop_token_ids, *self.tokenizer.end_of_turn_ids)))
        consecutive_errors = 0
        for index in range(self.limits.max_turns):
            max_total = await self._max_total_tokens()
            room = max_total - self._length()
            if room < 1:
                trajectory.finish_reason = FinishReason.CONTEXT_FULL
                return trajectory
            max_new = min(self.limits.max_new_tokens_per_turn, room)
            sampling = dataclasses.replace(self.sampling, max_new_tokens=max_new, stop_token_ids=stop_ids)
            started = time.monotonic()
            generation = await self.generate(trajectory.prompt_ids + trajectory.response_ids, sampling, self.rollout_id)
            llm_time = time.monotonic() - started
            if generation.finish_reason == "abort":
                # The server gave up on the request (a weight update pausing generation, an
                # overloaded engine): the turn is cut by the infrastructure, not by the model.
                raise LLMUnavailable(f"the LLM server {generation.server or ''} aborted the generation")
            generation = generation.clipped(max_new)
            assistant = {"role": "assistant", "content": self._reply_text(generation.output_ids)}

            calls, error = self._parse(assistant["content"])
            observations: list[dict[str, str]] = []
            submitted = False
            started = time.monotonic()
            for call in calls:
                result = await self.tools.call(call, self.limits.action_timeout_s)
                if result.submitted:
                    submitted = True
                    break  # calls after submit do not run
                observations.append({"role": "tool", "content": result.text})
            tool_time = time.monotonic() - started
            if error is not None:
                observations = [{"role": "tool", "content": error}]
            consecutive_errors = consecutive_errors + 1 if error is not None else 0

            observation_ids: list[int] = []
            finish = None
            if submitted:
                finish = FinishReason.SUBMITTED
            else:
                history = trajectory.messages
                observation_ids = list(self.tokenizer.encode_continuation(history, generation.output_ids, observations))
                next_length = self._length() + len(generation.output_ids) + len(observation_ids)
                if next_length + 1 > max_total:
                    finish = FinishReason.CONTEXT_FULL
                elif consecutive_errors >= self.limits.max_consecutive_format_errors:
                    finish = FinishReason.UNPARSABLE
                elif index + 1 >= self.limits.max_turns:
                    finish = FinishReason.MAX_TURNS
            if finish is not None:  # the final turn: no observation (see the module docstring)
                observation_ids, observations = [], []

            weight_version = generation.weight_version
            turn = TurnRecord(
                index=index,
                generated_ids=list(generation.output_ids),
                generated_logprobs=list(generation.logprobs),
                weight_version=self.policy_version() if weight_version is None else weight_version,
                tool_calls=list(calls),
                observation_ids=observation_ids,
                format_error=error is not None,
                llm_finish_reason=generation.finish_reason,
                llm_time_s=llm_time,
                tool_time_s=tool_time,
                llm_server=generation.server,
                generated_weight_versions=None
                if generation.weight_versions is None
                else list(generation.weight_versions),
            )
            trajectory.messages += [assistant, *observations]
            trajectory.append_turn(turn)
            if self.on_turn is not None:
                self.on_turn(turn)
            if finish is not None:
                trajectory.finish_reason = finish
                return trajectory
        trajectory.finish_reason = FinishReason.MAX_TURNS  # max_turns 0
        return trajectory

    async def _max_total_tokens(self) -> int:
        """max_total_tokens, or the LLM servers' context window when that is smaller: the rollout
        ends as CONTEXT_FULL (and is evaluated) before a server would refuse its prompt."""
        window = await self.context_length() if self.context_length is not None else None
        return min(self.limits.max_total_tokens, window) if window else self.limits.max_total_tokens

    def _with_instructions(self, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        """The prompt with the tool instructions appended to its system message (one is put first
        when there is none)."""
        instructions = tool_instructions(self.tools.tools, self.tool_call_format)
        chat = [dict(message) for message in messages]
        if chat and chat[0].get("role") == "system":
            content = chat[0].get("content", "")
            chat[0]["content"] = f"{content}\n\n{instructions}" if content else instructions
        else:
            chat.insert(0, {"role": "system", "content": instructions})
        return chat

    def _reply_text(self, output_ids: Sequence[int]) -> str:
        """The assistant message's text: the generated ids without their end-of-turn token."""
        end = len(output_ids)
        while end and output_ids[end - 1] in self.tokenizer.end_of_turn_ids:
            end -= 1
        return self.tokenizer.decode(output_ids[:end])

    def _parse(self, text: str) -> tuple[list[ToolCall], str | None]:
        """The reply's tool calls, or none and the observation that tells the model what was wrong."""
        try:
            calls = parse_tool_calls(text, self.tool_call_format)
        except ToolCallParseError as error:
            return [], f"Error: your tool call could not be read: {error}. {format_reminder(self.tool_call_format)}"
        if not calls:
            return [], f"Error: your reply has no tool call. {format_reminder(self.tool_call_format)}"
        return calls, None

    def _length(self) -> int:
        return len(self.trajectory.prompt_ids) + len(self.trajectory.response_ids)
