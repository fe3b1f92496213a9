"""The OpenAI wire format: reading chat and completions requests, writing their responses (whole
or as server-sent events). Sampling parameters a request may set for itself are in `CallOptions`;
every other sampling field (temperature, top_p, seed, penalties...) is ignored, because the task's
sampling decides what the rollout is trained on."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from corral.rollout.gateway.errors import RequestError
from corral.rollout.gateway.render import Conversation, Message, normalize_messages, normalize_tools
from corral.rollout.gateway.session import CallOptions, CallResult
from corral.rollout.types import ChatTokenizer


@dataclass(frozen=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    conversation: Conversation
    options: CallOptions
    stream: StreamOptions
    logprobs: bool


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    options: CallOptions
    stream: StreamOptions
    logprobs: bool
    return_token_ids: bool


def parse_chat_request(body: Any) -> ChatRequest:
    body = _object(body)
    tools = normalize_tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    max_tokens = _max_tokens(body, "max_completion_tokens") or _max_tokens(body, "max_tokens")
    options = CallOptions(max_tokens, _stop(body), parse_tool_calls=bool(tools) and tool_choice != "none")
    return ChatRequest(
        Conversation(normalize_messages(body.get("messages")), tools),
        options,
        _stream(body),
        _bool(body, "logprobs"),
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _object(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise RequestError("'logprobs' must be a non-negative integer or null", "logprobs")
    if body.get("echo"):
        raise RequestError("'echo' is not supported", "echo")
    return CompletionRequest(
        _prompt(body.get("prompt")),
        CallOptions(_max_tokens(body, "max_tokens"), _stop(body)),
        _stream(body),
        logprobs is not None,
        _bool(body, "return_token_ids"),
    )


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise RequestError("only n=1 is supported: each call is one step of one rollout", "n")
    return body


def _prompt(prompt: Any) -> str | list[int]:
    # A batch of one is read as its only prompt; a longer batch is refused.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt)
    ):
        return list(prompt)
    raise RequestError("'prompt' must be a non-empty string or a non-empty array of token ids (one prompt)", "prompt")


def _max_tokens(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"'{name}' must be a positive integer", name)
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or an array of strings", "stop")
    return tuple(s for s in stop if s)


def _stream(body: Mapping[str, Any]) -> StreamOptions:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    return StreamOptions(stream, stream and bool((options or {}).get("include_usage")))


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return bool(value)


# Responses.


@dataclass(frozen=True)
class ResponseContext:
    """What every response of a call carries besides the result."""

    model: str
    rollout_id: str
    id: str
    created: int

    @classmethod
    def new(cls, model: str, rollout_id: str, prefix: str) -> ResponseContext:
        return cls(model, rollout_id, f"{prefix}-{secrets.token_hex(12)}", int(time.time()))

    def envelope(self, obj: str, call_index: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "corral": {"rollout_id": self.rollout_id, "call_index": call_index},
        }


def usage(result: CallResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_ids), len(result.generation.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def openai_tool_calls(reply: Message) -> list[dict[str, Any]]:
    return [
        {
            "id": call["id"],
            "type": "function",
            "function": {
                "name": call["function"]["name"],
                "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False),
            },
        }
        for call in reply.get("tool_calls", ())
    ]


def chat_logprobs(result: CallResult, tokenizer: ChatTokenizer) -> dict[str, Any]:
    """One entry per generated token (end-of-turn tokens included), as chat logprobs."""
    content = []
    for token_id, logprob in zip(result.generation.output_ids, result.generation.logprobs):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


def completion_logprobs(result: CallResult, tokenizer: ChatTokenizer) -> dict[str, Any]:
    tokens = [tokenizer.decode([token_id]) for token_id in result.generation.output_ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(result.generation.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_response(
    context: ResponseContext, result: CallResult, reply: Message, request: ChatRequest, tokenizer: ChatTokenizer
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
    tool_calls = openai_tool_calls(reply)
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {
        "index": 0,
        "message": message,
        "logprobs": chat_logprobs(result, tokenizer) if request.logprobs else None,
        "finish_reason": result.finish_reason,
    }
    return {**context.envelope("chat.completion", result.call_index), "choices": [choice], "usage": usage(result)}


class ChatStream:
    """A streamed chat completion as chat.completion.chunk objects: the role with the first
    content, each content delta, then (`done`) the logprobs, the tool calls, the finish reason and
    usage when asked. `call_index` is asked at the first chunk (see app.py)."""

    def __init__(
        self, context: ResponseContext, request: ChatRequest, tokenizer: ChatTokenizer, call_index: Callable[[], int]
    ) -> None:
        self.context = context
        self.request = request
        self.tokenizer = tokenizer
        self._call_index = call_index
        self._envelope: dict[str, Any] | None = None
        self._extra = {"usage": None} if request.stream.include_usage else {}
        self._started = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        if self._envelope is None:
            self._envelope = self.context.envelope("chat.completion.chunk", self._call_index())
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._envelope, "choices": [choice], **self._extra}

    def _role(self) -> Iterator[dict[str, Any]]:
        if not self._started:
            self._started = True
            yield self._chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> Iterator[dict[str, Any]]:
        yield from self._role()
        yield self._chunk({"content": text})

    def done(self, result: CallResult, reply: Message) -> Iterator[dict[str, Any]]:
        if self._envelope is None:
            self._envelope = self.context.envelope("chat.completion.chunk", result.call_index)
        yield from self._role()
        if self.request.logprobs:
            yield self._chunk({"content": ""}, logprobs=chat_logprobs(result, self.tokenizer))
        tool_calls = openai_tool_calls(reply)
        if tool_calls:
            yield self._chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]})
        yield self._chunk({}, result.finish_reason)
        if self.request.stream.include_usage:
            yield {**self._envelope, "choices": [], "usage": usage(result)}


def completion_response(
    context: ResponseContext, result: CallResult, request: CompletionRequest, tokenizer: ChatTokenizer
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": result.text,
        "logprobs": completion_logprobs(result, tokenizer) if request.logprobs else None,
        "finish_reason": result.finish_reason,
    }
    response = {**context.envelope("text_completion", result.call_index), "choices": [choice], "usage": usage(result)}
    if request.return_token_ids:
        choice["token_ids"] = list(result.generation.output_ids)
        response["prompt_token_ids"] = list(result.prompt_ids)
    return response


class CompletionStream:
    """A streamed completion as text_completion chunks: each text delta, then (`done`) a chunk
    with the logprobs and token ids when asked, the finish reason, and usage when asked.
    `call_index` is asked at the first chunk (see app.py)."""

    def __init__(
        self,
        context: ResponseContext,
        request: CompletionRequest,
        tokenizer: ChatTokenizer,
        call_index: Callable[[], int],
    ) -> None:
        self.context = context
        self.request = request
        self.tokenizer = tokenizer
        self._call_index = call_index
        self._envelope: dict[str, Any] | None = None
        self._extra = {"usage": None} if request.stream.include_usage else {}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        if self._envelope is None:
            self._envelope = self.context.envelope("text_completion", self._call_index())
        choice = {"index": 0, "logprobs": None, "finish_reason": None, **choice}
        return {**self._envelope, "choices": [choice], **self._extra}

    def text(self, text: str) -> Iterator[dict[str, Any]]:
        yield self._chunk({"text": text})

    def done(self, result: CallResult) -> Iterator[dict[str, Any]]:
        if self._envelope is None:
            self._envelope = self.context.envelope("text_completion", result.call_index)
        whole = completion_response(self.context, result, self.request, self.tokenizer)
        choice = whole["choices"][0]
        if self.request.logprobs or self.request.return_token_ids:
            extra = {key: choice[key] for key in ("logprobs", "token_ids") if key in choice}
            tail = self._chunk({"text": "", **extra})
            if "prompt_token_ids" in whole:
                tail["prompt_token_ids"] = whole["prompt_token_ids"]
            yield tail
        yield self._chunk({"text": "", "finish_reason": choice["finish_reason"]})
        if self.request.stream.include_usage:
            yield {**self._envelope, "choices": [], "usage": whole["usage"]}


def sse_event(data: Mapping[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
