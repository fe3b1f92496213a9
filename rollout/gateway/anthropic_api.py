"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): reading a
request into the gateway's OpenAI-normalized `Conversation` and `CallOptions`, writing the reply
as a Message, whole or as Anthropic's server-sent events.

How a request is read (everything else about rendering and assembly is the shared core's):

- `system` (a string or text blocks) is the first system message. A block that is Claude Code's
  billing header (`x-anthropic-billing-header: ...`) is left out: it is request metadata that
  Claude Code writes into the prompt, and some of its versions change it on every request.
- `messages`: `user`, `assistant` and (mid-conversation system turns) `system` messages whose
  content is a string or blocks. Text blocks are text parts; an assistant's `tool_use` blocks
  are its tool calls (their ids kept); a user's `tool_result` blocks are tool messages (their
  `tool_use_id` the `tool_call_id`; content a string or text blocks), in block order with the
  user's text. `thinking` and `redacted_thinking` blocks are dropped, as Anthropic drops earlier
  turns' thinking: the gateway never returns them (it has no thinking of its own to return).
  `is_error` is not shown to the model (Claude Code writes its errors into the content).
- `tools` become function specs (`input_schema` the parameters); a tool with `defer_loading` is
  not shown to the model, as Anthropic does until a tool search loads it. `cache_control`
  anywhere is ignored.
- The task's sampling wins: `temperature`, `top_p`, `top_k`, `thinking`, `output_config.effort`,
  `metadata` and `service_tier` are accepted and ignored. `max_tokens` is required (as Anthropic
  requires it) and caps the reply below the task's limit; `stop_sequences` join the task's stops.
- Refused with 400 naming the field: unknown top-level fields, image/document and other block
  types, server tools (a `type` other than "custom"), `container`, `mcp_servers`, structured
  output, context edits other than clearing thinking.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from corral.rollout.gateway.errors import RequestError
from corral.rollout.gateway.render import Conversation, Message, normalize_messages, normalize_tools
from corral.rollout.gateway.session import CallOptions, CallResult
from corral.rollout.types import ChatTokenizer

# Top-level fields read, and fields accepted but ignored (see the module docstring).
_READ = {
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "max_tokens",
    "stop_sequences",
    "stream",
    "context_management",
    "output_config",
}
_IGNORED = {"metadata", "temperature", "top_p", "top_k", "thinking", "service_tier"}
BILLING_HEADER = "x-anthropic-billing-header:"
_DROPPED_BLOCKS = ("thinking", "redacted_thinking")
_TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control", "strict", "defer_loading"}


@dataclass(frozen=True)
class MessagesRequest:
    conversation: Conversation
    options: CallOptions
    stream: bool


def parse_messages_request(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """A Messages request (`count_only`: a count_tokens request, which has no max_tokens)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in body:
        if name not in _READ and name not in _IGNORED:
            raise RequestError(f"unknown or unsupported field '{name}'", name)
    if not isinstance(body.get("model", ""), str):
        raise RequestError("'model' must be a string", "model")
    _check_context_management(body.get("context_management"))
    _check_output_config(body.get("output_config"))
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count_only:
        raise RequestError("'max_tokens' is required", "max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError("'max_tokens' must be a positive integer", "max_tokens")
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    normalized_tools = normalize_tools([spec for spec, deferred in tools if not deferred])
    options = CallOptions(
        max_tokens, _stop_sequences(body), parse_tool_calls=bool(normalized_tools) and choice != "none"
    )
    return MessagesRequest(Conversation(normalize_messages(messages), normalized_tools), options, bool(stream))


def _check_context_management(value: Any) -> None:
    # Clearing earlier turns' thinking is what the gateway does anyway; any other edit (clearing
    # tool results) would change what the model sees, which the gateway does not do.
    if value is None:
        return
    edits = value.get("edits", []) if isinstance(value, dict) else None
    if not isinstance(edits, list):
        raise RequestError("'context_management' must be an object with an 'edits' array", "context_management")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str) or not kind.startswith("clear_thinking"):
            raise RequestError(
                f"context_management.edits[{i}]: only clearing thinking is supported (got {kind!r})",
                f"context_management.edits[{i}].type",
            )


def _check_output_config(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestError("'output_config' must be an object", "output_config")
    for name in value:
        if name != "effort":
            raise RequestError(
                f"output_config.{name} is not supported (only 'effort', ignored)", f"output_config.{name}"
            )


def _stop_sequences(body: Mapping[str, Any]) -> tuple[str, ...]:
    stops = body.get("stop_sequences")
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("'stop_sequences' must be an array of strings", "stop_sequences")
    return tuple(s for s in stops if s)


def _tools(raw: Any) -> list[tuple[dict[str, Any], bool]]:
    """Function specs, each with whether it is deferred (not shown to the model)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("'tools' must be an array of tool objects", "tools")
    specs = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object", where)
        if tool.get("type", "custom") != "custom":
            raise RequestError(
                f"{where}: server and built-in tools are not supported (type {tool.get('type')!r}); "
                "declare a custom tool with name, description and input_schema",
                f"{where}.type",
            )
        for name in tool:
            if name not in _TOOL_KEYS:
                raise RequestError(f"{where}.{name} is not supported", f"{where}.{name}")
        schema = tool.get("input_schema")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(schema, dict):
            raise RequestError(f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema")
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise RequestError(f"{where}.description must be a string", f"{where}.description")
            function["description"] = tool["description"]
        function["parameters"] = schema
        specs.append(({"type": "function", "function": function}, tool.get("defer_loading") is True))
    return specs


def _tool_choice(raw: Any, tools: list[tuple[dict[str, Any], bool]]) -> str:
    """The choice's type. It does not constrain the generation (the task's model answers as it
    will); "none" turns off reading tool calls from the reply."""
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError("'tool_choice' must be an object with type auto, any, tool or none", "tool_choice")
    if kind == "tool" and raw.get("name") not in {spec["function"]["name"] for spec, _ in tools}:
        raise RequestError(f"tool_choice names no declared tool ({raw.get('name')!r})", "tool_choice.name")
    return str(kind)


def _system(raw: Any) -> list[Message]:
    if raw is None or raw == "":
        return []
    if isinstance(raw, str):
        return [{"role": "system", "content": raw}]
    if not isinstance(raw, list):
        raise RequestError("'system' must be a string or an array of text blocks", "system")
    parts = []
    for i, block in enumerate(raw):
        text = _text_block(block, f"system[{i}]")
        if not text.startswith(BILLING_HEADER):
            parts.append({"type": "text", "text": text})
    return [{"role": "system", "content": parts}] if parts else []


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise RequestError(f"{where} must be a text block ({{'type': 'text', 'text': ...}})", where)
    return str(block["text"])


def _messages(raw: Any) -> list[Message]:
    """Anthropic messages as OpenAI-shaped ones (render.normalize_messages reads them)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array of message objects", "messages")
    out: list[Message] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object", where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"{where}.role must be user, assistant or system (got {role!r})", f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or an array of blocks", f"{where}.content")
        if role == "assistant":
            out.append(_assistant(content, f"{where}.content"))
        else:
            out.extend(_user_or_system(role, content, f"{where}.content"))
    return out


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise RequestError(f"{where} must be a content block object with a type", where)
    return kind


def _assistant(blocks: list[Any], where: str) -> Message:
    parts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{j}]")
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(block, f"{where}[{j}]")})
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}[{j}]"))
        elif kind not in _DROPPED_BLOCKS:
            raise RequestError(
                f"{where}[{j}]: unsupported block type {kind!r} in an assistant message", f"{where}[{j}].type"
            )
    message: Message = {"role": "assistant", "content": parts}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where}.id must be a non-empty string", f"{where}.id")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.input must be an object", f"{where}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _user_or_system(role: str, blocks: list[Any], where: str) -> list[Message]:
    """Text blocks as text parts; each tool_result (user only) as a tool message, in block order
    (consecutive text blocks make one message)."""
    out: list[Message] = []
    parts: list[dict[str, str]] = []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{j}]")
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(block, f"{where}[{j}]")})
        elif kind == "tool_result" and role == "user":
            if parts:
                out.append({"role": role, "content": parts})
                parts = []
            out.append(_tool_result(block, f"{where}[{j}]"))
        else:
            raise RequestError(
                f"{where}[{j}]: unsupported block type {kind!r} in a {role} message", f"{where}[{j}].type"
            )
    if parts or not out:
        out.append({"role": role, "content": parts})
    return out


def _tool_result(block: dict[str, Any], where: str) -> Message:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id")
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise RequestError(f"{where}.is_error must be a boolean", f"{where}.is_error")
    if isinstance(content, list):
        content = [
            {"type": "text", "text": _text_block(part, f"{where}.content[{k}]")} for k, part in enumerate(content)
        ]
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or an array of text blocks", f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# Responses.


@dataclass(frozen=True)
class MessageContext:
    model: str
    rollout_id: str
    id: str

    @classmethod
    def new(cls, model: str, rollout_id: str) -> MessageContext:
        return cls(model, rollout_id, f"msg_{secrets.token_hex(12)}")


def stop_sequence(result: CallResult, stops: tuple[str, ...], tokenizer: ChatTokenizer) -> str | None:
    """The stop string the reply ended on (the session cut the text where it begins), if any."""
    if result.generation.finish_reason != "stop" or result.tool_calls:
        return None
    ids = list(result.generation.output_ids)
    end_of_turn = set(tokenizer.end_of_turn_ids)
    while ids and ids[-1] in end_of_turn:
        ids.pop()
    rest = tokenizer.decode(ids)[len(result.text) :]
    return next((stop for stop in stops if stop and rest.startswith(stop)), None)


def stop_reason(result: CallResult, stop: str | None) -> str:
    if result.tool_calls:
        return "tool_use"
    if result.generation.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop is not None else "end_turn"


def content_blocks(reply: Message) -> list[dict[str, Any]]:
    """The reply's text (when there is any) and its tool calls as tool_use blocks, with the ids
    the session gave them."""
    blocks: list[dict[str, Any]] = []
    if reply["content"]:
        blocks.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls", ()):
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": call["function"]["arguments"],
            }
        )
    return blocks


def usage(result: CallResult) -> dict[str, int]:
    return {
        "input_tokens": len(result.prompt_ids),
        "output_tokens": len(result.generation.output_ids),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_response(context: MessageContext, result: CallResult, reply: Message, stop: str | None) -> dict[str, Any]:
    return {
        "id": context.id,
        "type": "message",
        "role": "assistant",
        "model": context.model,
        "content": content_blocks(reply),
        "stop_reason": stop_reason(result, stop),
        "stop_sequence": stop,
        "usage": usage(result),
        "corral": {"rollout_id": context.rollout_id, "call_index": result.call_index},
    }


def message_events(
    context: MessageContext, result: CallResult, reply: Message, stop: str | None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The reply as Anthropic's stream: message_start, per block content_block_start / one delta
    (text_delta, or the whole input as one input_json_delta) / content_block_stop, message_delta
    (stop reason, usage), message_stop."""
    whole = message_response(context, result, reply, stop)
    start = {**whole, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**whole["usage"], "output_tokens": 0}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(whole["content"]):
        opening: dict[str, Any]
        if block["type"] == "text":
            opening, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opening = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": opening}
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": stop},
            "usage": {"output_tokens": whole["usage"]["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}


def sse_frame(event: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
