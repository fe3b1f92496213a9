"""One rollout's side of the gateway: its limits, its assembler, and the path of one call from
prompt ids to a recorded generation. No HTTP here (app.py speaks that)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

from corral.rollout.gateway.assembly import (
    CallPlan,
    GatewayCounters,
    HistoryPolicy,
    TrajectoryAssembler,
)
from corral.rollout.gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    HistoryRewritten,
    MaxTurnsExceeded,
    Unavailable,
    UnknownKey,
)
from corral.rollout.gateway.render import ChatRenderer, Conversation, Message
from corral.rollout.gateway.streaming import CallDone, ContentHoldback, StreamEvent, TextDelta
from corral.rollout.tool_calls import ToolCallFormat, ToolCallParseError, parse_tool_calls, strip_tool_calls
from corral.rollout.types import (
    ChatTokenizer,
    DeltaSink,
    GenerateFn,
    Generation,
    GenerationDelta,
    LLMUnavailable,
    SamplingOptions,
    StreamingGenerateFn,
    ToolCall,
    Trajectory,
    TurnRecord,
)

_T = TypeVar("_T")


@dataclass(frozen=True)
class SessionSettings:
    sampling: SamplingOptions  # the TASK's sampling (temperature/top_p/top_k/stop); wins over the request's
    max_new_tokens_per_turn: int  # a request's max_tokens/max_completion_tokens is honoured only below this
    max_total_tokens: int  # prompt+completion of one sample; also capped by the servers' context window
    max_calls: int  # = task max_turns
    tool_call_format: ToolCallFormat = ToolCallFormat.HERMES  # how tool calls appear in model text
    history_policy: HistoryPolicy = HistoryPolicy.SPLIT


@dataclass
class GatewayOutcome:
    """What a session leaves when it is closed."""

    samples: list[Trajectory]  # in call order; finish_reason None
    counters: GatewayCounters
    history_rewritten: str | None = None  # set when the FAIL policy tripped (the message)
    llm_unavailable: str | None = None  # set when a generation failed (the harness got HTTP 503)
    context_full: bool = False  # a call was refused: its prompt left no room (400 context_length_exceeded)
    max_calls_reached: bool = False  # a call past max_calls was refused (400 max_turns_exceeded)


@dataclass(frozen=True)
class CallOptions:
    """What a request may ask for itself."""

    max_tokens: int | None = None  # honoured below the session's max_new_tokens_per_turn
    stop: tuple[str, ...] = ()  # added to the task's stop strings
    parse_tool_calls: bool = False  # the request declared tools: read the reply's tool calls


@dataclass
class CallResult:
    call_index: int
    prompt_ids: list[int]
    generation: Generation
    # The generated ids' text without trailing end-of-turn tokens and without the stop string it
    # ended on (as OpenAI's content), though both stay in the recorded ids.
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    format_error: bool = False  # the reply names a tool call that cannot be read
    llm_time_s: float = 0.0

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "tool_calls", "length" or "stop"."""
        if self.tool_calls:
            return "tool_calls"
        return "length" if self.generation.finish_reason == "length" else "stop"


class GatewaySession:
    """One rollout's calls. They run one at a time, in arrival order (`lock`), so the samples
    follow the call order."""

    def __init__(
        self,
        rollout_id: str,
        settings: SessionSettings,
        *,
        generate: GenerateFn | StreamingGenerateFn,
        tokenizer: ChatTokenizer,
        policy_version: Callable[[], int],
        context_length: Callable[[], Awaitable[int | None]] | None,
    ) -> None:
        self.key = secrets.token_urlsafe(24)
        self.rollout_id = rollout_id
        self.settings = settings
        self.counters = GatewayCounters()
        self.lock = asyncio.Lock()
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, settings.tool_call_format)
        self.assembler = TrajectoryAssembler(self.renderer, settings.history_policy, self.counters)
        self._generate = cast(GenerateFn, generate)
        # Whether the GenerateFn streams (takes `on_delta`, as LLMPool.generate does).
        self._streams = _takes_on_delta(generate)
        self._policy_version = policy_version
        self._context_length = context_length
        self._end_of_turn = frozenset(tokenizer.end_of_turn_ids)
        self._stop_ids = tuple(dict.fromkeys((*settings.sampling.stop_token_ids, *tokenizer.end_of_turn_ids)))
        self.outcome = GatewayOutcome(samples=[], counters=self.counters)
        self.closed = False

    async def chat(self, conversation: Conversation, options: CallOptions) -> tuple[CallResult, Message]:
        """Generates the reply to `conversation`; returns it and the assistant message as returned
        to the harness (normalized)."""
        async with self.lock:
            plan, sampling = await self._prepare(self.assembler.plan_chat, conversation, options)
            generation, llm_time = await self._call_llm(plan.prompt_ids, sampling, None)
            return self._commit_chat(plan, self._result(plan, sampling, options, generation, llm_time))

    async def complete(self, prompt: str | list[int], options: CallOptions) -> CallResult:
        """Generates after `prompt`: token ids, sent as they are, or text (special-token strings
        in it become their ids)."""
        async with self.lock:
            plan, sampling = await self._prepare(self.assembler.plan_tokens, self._prompt_ids(prompt), options)
            generation, llm_time = await self._call_llm(plan.prompt_ids, sampling, None)
            result = self._result(plan, sampling, options, generation, llm_time)
            self._commit(plan, result, None)
            return result

    async def chat_stream(self, conversation: Conversation, options: CallOptions) -> AsyncGenerator[StreamEvent, None]:
        """`chat`, streamed: TextDelta as the reply's content is generated (never text the final
        content will not have: see streaming.py), then CallDone with what `chat` returns. Refusals
        and a failure before the first delta raise before anything is yielded, as `chat` raises.
        Closing the iterator before the end cancels the generation, and nothing is recorded."""
        async with self.lock:
            plan, sampling = await self._prepare(self.assembler.plan_chat, conversation, options)
            holdback = self._holdback(sampling, self.settings.tool_call_format if options.parse_tool_calls else None)
            outcome: list[tuple[Generation, float]] = []
            async for text in self._streamed(plan.prompt_ids, sampling, holdback, outcome):
                yield TextDelta(text)
            result, reply = self._commit_chat(plan, self._result(plan, sampling, options, *outcome[0]))
            if rest := holdback.rest(reply["content"]):
                yield TextDelta(rest)
            yield CallDone(result, reply)

    async def complete_stream(self, prompt: str | list[int], options: CallOptions) -> AsyncGenerator[StreamEvent, None]:
        """`complete`, streamed as `chat_stream` (the content is the result's text)."""
        async with self.lock:
            plan, sampling = await self._prepare(self.assembler.plan_tokens, self._prompt_ids(prompt), options)
            holdback = self._holdback(sampling, None)
            outcome: list[tuple[Generation, float]] = []
            async for text in self._streamed(plan.prompt_ids, sampling, holdback, outcome):
                yield TextDelta(text)
            result = self._result(plan, sampling, options, *outcome[0])
            self._commit(plan, result, None)
            if rest := holdback.rest(result.text):
                yield TextDelta(rest)
            yield CallDone(result)

    def reply_content(self, result: CallResult) -> str:
        """The message content: the reply text, without the tool calls' markup when tool calls
        were read from it."""
        if not result.tool_calls:
            return result.text
        return strip_tool_calls(result.text, self.settings.tool_call_format)

    def close(self) -> GatewayOutcome:
        if not self.closed:
            self.closed = True
            self.outcome.samples = self.assembler.close()
        return self.outcome

    def _plan(self, plan: Callable[[_T], CallPlan], request: _T) -> CallPlan:
        try:
            return plan(request)
        except HistoryRewritten:
            self.outcome.history_rewritten = self.assembler.history_rewritten
            raise

    def _check_usable(self) -> None:
        if self.closed:  # closed while the call waited for the one before it
            raise UnknownKey()
        if self.counters.calls >= self.settings.max_calls:
            self.outcome.max_calls_reached = True
            raise MaxTurnsExceeded(f"this rollout already made its {self.settings.max_calls} LLM calls (max_turns)")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.renderer.encode_text(prompt) if isinstance(prompt, str) else prompt

    async def _prepare(
        self, plan: Callable[[_T], CallPlan], request: _T, options: CallOptions
    ) -> tuple[CallPlan, SamplingOptions]:
        """The call's plan and sampling; raises the refusals (closed, past max_calls, history
        rewritten under FAIL, no room left)."""
        self._check_usable()
        planned = self._plan(plan, request)
        window = await self._context_length() if self._context_length is not None else None
        return planned, self._sampling(planned, options, window)

    def _sampling(self, plan: CallPlan, options: CallOptions, window: int | None) -> SamplingOptions:
        prompt = plan.prompt_ids
        limit = self.settings.max_total_tokens
        if window:
            limit = min(limit, window)
        room = limit - len(prompt)
        if room < 1:
            self.outcome.context_full = True
            raise ContextLengthExceeded(
                f"the prompt is {len(prompt)} tokens; this rollout's samples may have at most {limit} "
                "(prompt and completion)",
                "messages",
            )
        max_new = min(self.settings.max_new_tokens_per_turn, room)
        if options.max_tokens is not None:
            max_new = min(max_new, options.max_tokens)
        return dataclasses.replace(
            self.settings.sampling,
            max_new_tokens=max_new,
            stop=tuple(dict.fromkeys((*self.settings.sampling.stop, *options.stop))),
            stop_token_ids=self._stop_ids,
        )

    async def _call_llm(
        self, prompt: list[int], sampling: SamplingOptions, on_delta: DeltaSink | None
    ) -> tuple[Generation, float]:
        """The generation and the time it took; Unavailable when no server could generate."""
        started = time.monotonic()
        try:
            if on_delta is None:
                generation = await self._generate(prompt, sampling, self.rollout_id)
            else:
                generation = await cast(StreamingGenerateFn, self._generate)(
                    prompt, sampling, self.rollout_id, on_delta=on_delta
                )
        except LLMUnavailable as error:
            self.outcome.llm_unavailable = str(error) or type(error).__name__
            raise Unavailable(f"no LLM server could generate: {self.outcome.llm_unavailable}") from None
        return generation, time.monotonic() - started

    def _holdback(self, sampling: SamplingOptions, tool_call_format: ToolCallFormat | None) -> ContentHoldback:
        return ContentHoldback(
            self.tokenizer, self._end_of_turn, sampling.stop, tool_call_format, sampling.max_new_tokens
        )

    async def _streamed(
        self,
        prompt: list[int],
        sampling: SamplingOptions,
        holdback: ContentHoldback,
        outcome: list[tuple[Generation, float]],
    ) -> AsyncIterator[str]:
        """Generates streamed, yielding the text `holdback` lets through as the ids arrive, and
        puts the generation and its time in `outcome`. A GenerateFn that cannot stream is called
        whole (its text comes at the end). Closed early, it cancels the generation."""
        if not self._streams:
            outcome.append(await self._call_llm(prompt, sampling, None))
            return
        deltas: asyncio.Queue[GenerationDelta | None] = asyncio.Queue()
        call = asyncio.ensure_future(self._call_llm(prompt, sampling, deltas.put_nowait))
        call.add_done_callback(lambda _: deltas.put_nowait(None))
        try:
            while (delta := await deltas.get()) is not None:
                if text := holdback.feed(delta.ids):
                    yield text
            outcome.append(call.result())
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, GatewayError):
                    await call

    def _result(
        self, plan: CallPlan, sampling: SamplingOptions, options: CallOptions, generation: Generation, llm_time: float
    ) -> CallResult:
        """The call's result: the generation cut to its limit, its text and tool calls;
        Unavailable when the server aborted it."""
        if generation.finish_reason == "abort":
            self.outcome.llm_unavailable = f"the LLM server {generation.server} aborted the generation"
            raise Unavailable(self.outcome.llm_unavailable)
        generation = generation.clipped(sampling.max_new_tokens)  # never outgrow the limits, whatever a server does
        text = self.tokenizer.decode(self._without_end_of_turn(generation.output_ids))
        if generation.finish_reason == "stop":
            text = _without_stop_string(text, sampling.stop)
        calls: list[ToolCall] = []
        format_error = False
        if options.parse_tool_calls:
            try:
                calls = parse_tool_calls(text, self.settings.tool_call_format)
            except ToolCallParseError:
                format_error = True
        return CallResult(-1, plan.prompt_ids, generation, text, calls, format_error, llm_time)

    def _commit_chat(self, plan: CallPlan, result: CallResult) -> tuple[CallResult, Message]:
        reply: Message = {"role": "assistant", "content": self.reply_content(result)}
        if result.tool_calls:
            # The ids the harness is given; it sends them back with the reply and the results,
            # and the assembly checks that they are these.
            reply["tool_calls"] = [
                {
                    "id": new_tool_call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in result.tool_calls
            ]
        self._commit(plan, result, reply)
        return result, reply

    def _commit(self, plan: CallPlan, result: CallResult, reply: Message | None) -> None:
        if self.closed:  # closed while the call was generating: recorded nowhere
            raise UnknownKey()
        generation = result.generation
        turn = TurnRecord(
            index=0,
            generated_ids=list(generation.output_ids),
            generated_logprobs=list(generation.logprobs),
            weight_version=self._policy_version() if generation.weight_version is None else generation.weight_version,
            tool_calls=list(result.tool_calls),
            observation_ids=[],
            format_error=result.format_error,
            llm_finish_reason=generation.finish_reason,
            llm_time_s=result.llm_time_s,
            tool_time_s=0.0,
            llm_server=generation.server,
            generated_weight_versions=None if generation.weight_versions is None else list(generation.weight_versions),
        )
        result.call_index = self.assembler.commit(plan, turn, reply, result.text)

    def _without_end_of_turn(self, ids: Sequence[int]) -> Sequence[int]:
        end = len(ids)
        while end and ids[end - 1] in self._end_of_turn:
            end -= 1
        return ids[:end]


def _takes_on_delta(generate: Callable[..., object]) -> bool:
    try:
        return "on_delta" in inspect.signature(generate).parameters
    except (TypeError, ValueError):  # a callable without a signature: called whole
        return False


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _without_stop_string(text: str, stops: Sequence[str]) -> str:
    """The text before the stop string the reply ended on. The engine stops on the token that
    completes a stop string, and that token may run past it (" tests" completes "e"), so the
    text is cut where the first stop string in it begins, not only at its end."""
    starts = [at for at in (text.find(stop) for stop in stops if stop) if at >= 0]
    return text[: min(starts)] if starts else text
