"""The vocabulary the agent loop, the LLM clients, the tools and the pipeline share.

Kept free of I/O so that trainer adapters can import it without a daemon.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# The weight version of tokens that no model generated (template and observation tokens).
NO_WEIGHT_VERSION = -1


class LLMUnavailable(Exception):
    """No LLM server could serve a generation (all down, or retries exhausted). The rollout is
    filtered (reason LLM_UNREACHABLE), never scored."""


class SandboxFailure(Exception):
    """The sandbox or its backend failed under the agent (not the agent's doing): the rollout is
    filtered (reason BACKEND_CRASH)."""


@dataclass(frozen=True)
class SamplingOptions:
    """What one generation call asks of the LLM server."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # no limit
    stop: tuple[str, ...] = ()
    # Token ids that end generation besides the server's own EOS (the chat template's end of turn).
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """What the LLM server returned for one call: exactly the ids it generated (including the stop
    token when it stopped on one), one logprob per id, and the weight version that produced them."""

    output_ids: list[int]
    logprobs: list[float]
    # "stop" (end of turn or stop string), "length" (max_new_tokens), "abort".
    finish_reason: str
    # None when the server does not report one; the caller then uses the trainer's policy version.
    # The oldest when the weights changed mid-generation (staleness is measured by it).
    weight_version: int | None = None
    # Which server generated it (a base URL), for the per-turn record.
    server: str = ""
    # The weight version of each generated id, when the server reports one per token (vLLM's
    # spans, SGLang's label on each streamed chunk); None otherwise.
    weight_versions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.output_ids)} output ids but {len(self.logprobs)} logprobs")
        if self.weight_versions is not None and len(self.weight_versions) != len(self.output_ids):
            raise ValueError(f"{len(self.output_ids)} output ids but {len(self.weight_versions)} weight versions")

    def clipped(self, max_new: int) -> Generation:
        """At most `max_new` ids (finish "length" when cut): a server that returned more than asked
        must not make a sample outgrow its limits."""
        if len(self.output_ids) <= max_new:
            return self
        versions = self.weight_versions
        return dataclasses.replace(
            self,
            output_ids=self.output_ids[:max_new],
            logprobs=self.logprobs[:max_new],
            finish_reason="length",
            weight_versions=None if versions is None else versions[:max_new],
        )


@dataclass(frozen=True)
class GenerationDelta:
    """Ids a streamed generation produced since the last delta, their logprobs, and the weight
    version the server labelled them with (None when it did not). The deltas of a generation,
    joined, are its Generation's output_ids and logprobs (a prefix of them when it fails)."""

    ids: list[int]
    logprobs: list[float]
    weight_version: int | None = None


# Called with each delta as it arrives (synchronously: it must not block).
DeltaSink = Callable[[GenerationDelta], None]


# generate(prompt_ids, sampling, rollout_id) -> Generation. rollout_id lets a server pool keep one
# rollout on one server (prefix cache). Raises LLMUnavailable.
GenerateFn = Callable[[list[int], SamplingOptions, str], Awaitable[Generation]]


class StreamingGenerateFn(Protocol):
    """A GenerateFn that also streams: given `on_delta`, it generates streamed and calls it with
    the ids as they come, then returns the same Generation as without it."""

    def __call__(
        self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str, *, on_delta: DeltaSink | None = None
    ) -> Awaitable[Generation]: ...


class ChatTokenizer(Protocol):
    """Turns chat messages into token ids without ever re-tokenizing what came before.

    Messages are dicts with "role" and "content" (str).
    """

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn (generation stops on them)."""

    def encode_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The ids of the conversation so far, followed by the assistant generation prompt."""

    def encode_continuation(
        self,
        history: Sequence[Mapping[str, str]],
        generated_ids: Sequence[int],
        new_messages: Sequence[Mapping[str, str]],
    ) -> list[int]:
        """The ids to append after `generated_ids` so that the sequence continues with
        `new_messages` and then the next generation prompt: closing tokens the generation lacked,
        the template around the new messages, their content. `history` is the chat before this
        assistant turn; `generated_ids` is the turn as the model produced it."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens included."""


class ToolName(str, enum.Enum):
    BASH = "bash"
    PYTHON = "python"
    EDITOR = "editor"
    SUBMIT = "submit"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False, sort_keys=True)


@dataclass(frozen=True)
class ToolResult:
    """An observation for the model. `submitted`: the agent ended the episode."""

    text: str
    submitted: bool = False


class ToolBox(Protocol):
    """Runs the agent's tool calls in one sandbox. Raises SandboxFailure when the sandbox itself
    fails; anything the agent did wrong comes back as observation text."""

    tools: frozenset[str]

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult: ...


class FinishReason(str, enum.Enum):
    """Why the agent stopped; values match the proto enum's suffixes."""

    SUBMITTED = "SUBMITTED"
    MAX_TURNS = "MAX_TURNS"
    CONTEXT_FULL = "CONTEXT_FULL"
    TIMEOUT = "TIMEOUT"
    UNPARSABLE = "UNPARSABLE"


@dataclass
class TurnRecord:
    index: int
    generated_ids: list[int]
    generated_logprobs: list[float]
    weight_version: int
    tool_calls: list[ToolCall]
    observation_ids: list[int]
    format_error: bool
    llm_finish_reason: str
    llm_time_s: float
    tool_time_s: float
    llm_server: str = ""
    # Per generated id, when the server reported versions per token (else weight_version for all).
    generated_weight_versions: list[int] | None = None


@dataclass
class Trajectory:
    """A rollout's token sequence as it was built: prompt_ids, then response_ids, which are the
    concatenation over turns of generated_ids (mask 1) and observation_ids (mask 0). Only complete
    turns are in it, so it is consistent at any moment (a RUN timeout keeps what was done)."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    format_errors: int = 0

    def append_turn(self, turn: TurnRecord) -> None:
        self.response_ids += turn.generated_ids
        self.response_mask += [1] * len(turn.generated_ids)
        self.response_logprobs += turn.generated_logprobs
        if turn.generated_weight_versions is not None and len(turn.generated_weight_versions) == len(
            turn.generated_ids
        ):
            self.weight_versions += turn.generated_weight_versions
        else:
            self.weight_versions += [turn.weight_version] * len(turn.generated_ids)
        self.response_ids += turn.observation_ids
        self.response_mask += [0] * len(turn.observation_ids)
        self.response_logprobs += [0.0] * len(turn.observation_ids)
        self.weight_versions += [NO_WEIGHT_VERSION] * len(turn.observation_ids)
        self.turns.append(turn)
        self.format_errors += int(turn.format_error)

    @property
    def oldest_weight_version(self) -> int | None:
        versions = [turn.weight_version for turn in self.turns if turn.generated_ids]
        return min(versions) if versions else None
