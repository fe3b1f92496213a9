"""What the gateway tests share: a scripted LLM that records every call, session settings, and
the token-exactness check of an assembled sample against the calls that built it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from corral.rollout.gateway import GatewaySession, HistoryPolicy, SessionSettings
from corral.rollout.tokenizer import IM_END, ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat
from corral.rollout.types import DeltaSink, Generation, GenerationDelta, LLMUnavailable, SamplingOptions, Trajectory

TOK = ByteChatTokenizer()
IM_END_ID = TOK.special_ids[IM_END]

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


@dataclass
class LLMCall:
    prompt_ids: list[int]
    generation: Generation
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]


@dataclass
class ScriptedLLM:
    """A GenerateFn answering with `replies` in turn (the last one repeats), each followed by
    <|im_end|>; every generated token gets its own logprob, so misaligned logprobs show. Cut at
    max_new_tokens with finish "length". `fail_with`: raise it on the next call."""

    replies: list[str]
    weight_version: int | None = 7
    tokenizer: Any = TOK
    end_id: int = IM_END_ID
    calls: list[LLMCall] = field(default_factory=list)
    fail_with: Exception | None = None
    finish_reason: str | None = None
    token_delay_s: float = 0.0
    started: int = 0

    async def __call__(
        self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str, *, on_delta: DeltaSink | None = None
    ) -> Generation:
        self.started += 1
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        text = self.replies[min(len(self.calls), len(self.replies) - 1)]
        ids = self.tokenizer.encode(text) + [self.end_id]
        finish = self.finish_reason or "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        base = len(self.calls) + 1
        logprobs = [-(base + i / 10_000) for i in range(len(ids))]
        generation = Generation(ids, logprobs, finish, self.weight_version, "scripted")
        if on_delta is not None:
            for token, logprob in zip(ids, logprobs):
                await asyncio.sleep(self.token_delay_s)
                on_delta(GenerationDelta([token], [logprob], self.weight_version))
        self.calls.append(
            LLMCall(list(prompt_ids), generation, sampling.max_new_tokens, sampling.stop, sampling.stop_token_ids)
        )
        return generation


class Unreachable(LLMUnavailable):
    pass


def settings(
    policy: HistoryPolicy = HistoryPolicy.SPLIT,
    *,
    max_calls: int = 50,
    max_total_tokens: int = 100_000,
    max_new_tokens_per_turn: int = 4096,
    fmt: ToolCallFormat = ToolCallFormat.HERMES,
) -> SessionSettings:
    return SessionSettings(
        sampling=SamplingOptions(max_new_tokens=1, temperature=0.7, top_p=0.9, stop=("STOP!",)),
        max_new_tokens_per_turn=max_new_tokens_per_turn,
        max_total_tokens=max_total_tokens,
        max_calls=max_calls,
        tool_call_format=fmt,
        history_policy=policy,
    )


def assert_token_exact(sample: Trajectory, calls: Sequence[LLMCall]) -> None:
    """`sample` is exactly the last call's prompt and output; every call's output sits where its
    prompt ended, with mask 1 and its logprobs; everything else has mask 0."""
    last = calls[-1]
    assert sample.prompt_ids + sample.response_ids == last.prompt_ids + last.generation.output_ids
    start = len(sample.prompt_ids)
    mask = [0] * len(sample.response_ids)
    logprobs = [0.0] * len(sample.response_ids)
    for call in calls:
        at = len(call.prompt_ids) - start
        assert at >= 0
        assert sample.response_ids[at : at + len(call.generation.output_ids)] == call.generation.output_ids
        for offset, logprob in enumerate(call.generation.logprobs):
            mask[at + offset] = 1
            logprobs[at + offset] = logprob
    assert sample.response_mask == mask
    assert sample.response_logprobs == logprobs
    assert len(sample.weight_versions) == len(sample.response_ids)
    assert [len(turn.generated_ids) for turn in sample.turns] == [len(c.generation.output_ids) for c in calls]


class Window:
    """A context_length() whose answer a test sets (`tokens`; None: unknown)."""

    def __init__(self, tokens: int | None = None) -> None:
        self.tokens = tokens

    async def __call__(self) -> int | None:
        return self.tokens


def make_session(
    llm: ScriptedLLM, config: SessionSettings | None = None, *, tokenizer: Any = TOK, window: Window | None = None
) -> GatewaySession:
    """A session on `llm`; generations without a server weight version are stamped 42."""
    return GatewaySession(
        "rollout-1",
        config or settings(),
        generate=llm,
        tokenizer=tokenizer,
        policy_version=lambda: 42,
        context_length=window,
    )


async def post_json(url: str, path: str, body: Any, key: str | None) -> tuple[int, Any]:
    """POSTs `body` (JSON, or bytes/str as they are) to url + path with the key as a Bearer token;
    the status and the answer (parsed when it is JSON, else its text)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with aiohttp.ClientSession() as http, http.post(url + path, data=data, headers=headers) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text
