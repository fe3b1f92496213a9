"""OpenAI's Responses wire format (`POST /v1/responses`): reading a request into the gateway's
`Conversation` (the chat-completions shape every API shares) and writing the reply as a response
object, whole or as the Responses server-sent events.

Input items become chat messages:

- `instructions` -> a system message first; `message` items (roles user, assistant, system,
  developer; text as a string or `input_text` / `output_text` parts) -> messages;
- `function_call` {call_id, name, arguments} -> a tool call of an assistant message (joined to the
  assistant message just before it, so a reply of text and calls sent back is one message, as the
  gateway returned it); `function_call_output` {call_id, output} -> a tool message;
- `custom_tool_call` {call_id, name, input} -> a tool call whose arguments are {"input": input};
  `custom_tool_call_output` -> a tool message.

Tools: `function` tools become chat function specs; `custom` (freeform) tools, whose input is a raw
string, are shown to the model as a function with one string argument `input`, the tool's format
(its grammar, if any) in that argument's description. A reply's call of a custom tool whose
arguments are exactly {"input": <string>} comes back as a `custom_tool_call` item, any other call
as a `function_call` item; either way the `call_id` is the session's id for the call, which the
harness sends back and the assembly compares.

Refused with 400 naming the field: anything the gateway cannot do or would have to pretend to do
(images, files, audio, server-side tools, stored responses, `previous_response_id`, structured
output formats, background mode), reasoning items (the gateway returns none, so none sent back can
be its own), and unknown fields. Sampling fields are the task's (ignored here, as for chat).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from corral.rollout.gateway.errors import RequestError
from corral.rollout.gateway.openai_api import chat_logprobs
from corral.rollout.gateway.render import Conversation, Message, normalize_messages, normalize_tools
from corral.rollout.gateway.session import CallOptions, CallResult
from corral.rollout.types import ChatTokenizer

# Fields read below, and fields accepted and ignored: the task decides sampling, nothing is
# stored or billed, and metadata is the harness's own.
_READ = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "store", "previous_response_id", "include", "text", "reasoning", "stream", "stream_options", "truncation",
    "background", "conversation", "prompt",
}  # fmt: skip
_IGNORED = {
    "temperature", "top_p", "top_logprobs", "seed", "service_tier", "metadata", "client_metadata", "user",
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "max_tool_calls",
}  # fmt: skip
# `include` values: output_text logprobs are given; reasoning.encrypted_content asks for what the
# gateway never returns (no reasoning items), so it changes nothing; the rest name outputs of
# tools the gateway refuses, so they can never apply.
_INCLUDES = {
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
}
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
_CALL_ITEMS = ("function_call", "custom_tool_call")
_OUTPUT_ITEMS = {"function_call_output": "function_call", "custom_tool_call_output": "custom_tool_call"}
_REASONING_KEYS = {"effort", "summary", "generate_summary"}
CUSTOM_INPUT = "input"  # the one argument a custom tool is called with


@dataclass(frozen=True)
class ResponsesRequest:
    conversation: Conversation
    options: CallOptions
    stream: bool
    logprobs: bool  # include has message.output_text.logprobs
    custom_tools: frozenset[str]  # names of the request's custom (freeform) tools
    echo: dict[str, Any]  # request fields the response object repeats


def parse_responses_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - _READ - _IGNORED)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", unknown[0])
    for name, why in (
        ("previous_response_id", "responses are not stored: send the whole conversation in 'input'"),
        ("conversation", "conversations are not stored: send the whole conversation in 'input'"),
        ("prompt", "stored prompt templates are not supported: send 'instructions' and 'input'"),
    ):
        if body.get(name) is not None:
            raise RequestError(f"'{name}' is not supported: {why}", name)
    if _flag(body, "background"):
        raise RequestError("'background' is not supported: each call is answered while the harness waits", "background")
    if body.get("truncation", "disabled") not in (None, "disabled"):
        raise RequestError("'truncation' must be 'disabled': the gateway never drops input items", "truncation")
    _flag(body, "store")  # nothing is kept either way: the response says store false
    _text_config(body.get("text"))
    _reasoning_config(body.get("reasoning"))
    include = _include(body.get("include"))
    tools, custom = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), {tool["function"]["name"] for tool in tools})
    parallel = _flag(body, "parallel_tool_calls", default=True)
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError("'max_output_tokens' must be a positive integer", "max_output_tokens")
    stream = _flag(body, "stream")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    messages = _messages(body.get("instructions"), body.get("input"))
    options = CallOptions(max_tokens, (), parse_tool_calls=bool(tools) and tool_choice != "none")
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": max_tokens,
        "parallel_tool_calls": parallel,
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "tools": body.get("tools") or [],
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
    }
    return ResponsesRequest(
        Conversation(normalize_messages(messages), normalize_tools(tools)),
        options,
        stream,
        "message.output_text.logprobs" in include,
        frozenset(custom),
        echo,
    )


def _flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return value


def _text_config(text: Any) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise RequestError("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        # json_schema / json_object would promise output the gateway does not constrain.
        raise RequestError("only the 'text' output format is supported (no structured outputs)", "text.format")
    verbosity = text.get("verbosity")  # a hint to the model; the task's prompt decides
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise RequestError("'text.verbosity' must be low, medium or high", "text.verbosity")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise RequestError(f"unknown field 'text.{unknown[0]}'", f"text.{unknown[0]}")


def _reasoning_config(reasoning: Any) -> None:
    """The effort is the model's business (ignored); summaries may be asked for, and none come
    (the gateway returns no reasoning items, which a summary of "auto" allows); anything else
    would change what comes back, so it is refused."""
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise RequestError("'reasoning' must be an object", "reasoning")
    unknown = sorted(set(reasoning) - _REASONING_KEYS)
    if unknown:
        raise RequestError(f"unknown field 'reasoning.{unknown[0]}'", f"reasoning.{unknown[0]}")
    effort = reasoning.get("effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise RequestError("'reasoning.effort' must be none, minimal, low, medium, high or xhigh", "reasoning.effort")
    for key in ("summary", "generate_summary"):
        value = reasoning.get(key)
        if value is not None and value not in ("auto", "concise", "detailed", "none"):
            raise RequestError(f"'reasoning.{key}' must be auto, concise, detailed or none", f"reasoning.{key}")


def _include(include: Any) -> set[str]:
    if include is None:
        return set()
    if not isinstance(include, list) or not all(isinstance(value, str) for value in include):
        raise RequestError("'include' must be an array of strings", "include")
    for value in include:
        if value not in _INCLUDES:
            raise RequestError(f"'include' has an unknown value {value!r}", "include")
    return set(include)


def _tools(raw: Any) -> tuple[list[Message], list[str]]:
    """Chat function specs for the request's tools, and the names of its custom tools."""
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise RequestError("'tools' must be an array of tool objects", "tools")
    specs, custom = [], []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object", where)
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            raise RequestError(
                f"{where}: tools of type {kind!r} are not supported (only 'function' and 'custom' tools: "
                "the gateway runs no tools itself)",
                f"{where}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.description must be a string", f"{where}.description")
        function: dict[str, Any] = {"name": name}
        if description:
            function["description"] = description
        if kind == "function":
            parameters = tool.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise RequestError(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
            function["parameters"] = parameters or {"type": "object", "properties": {}}
        else:
            function["parameters"] = _custom_parameters(tool.get("format"), where)
            custom.append(name)
        specs.append({"type": "function", "function": function})
    return specs, custom


def _custom_parameters(fmt: Any, where: str) -> dict[str, Any]:
    """A custom tool's input as one string argument; its format (text, or a grammar) said in the
    argument's description, so the model sees what the harness expects."""
    description = "The tool's input, as raw text."
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
            raise RequestError(f"{where}.format must be {{'type': 'text'}} or a grammar", f"{where}.format")
        if fmt["type"] == "grammar":
            syntax, definition = fmt.get("syntax"), fmt.get("definition")
            if not isinstance(syntax, str) or not isinstance(definition, str):
                raise RequestError(f"{where}.format: a grammar needs a string syntax and definition", f"{where}.format")
            description = f"The tool's input, as raw text in this {syntax} grammar:\n{definition}"
    return {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": description}},
        "required": [CUSTOM_INPUT],
    }


def _tool_choice(choice: Any, names: set[str]) -> str | dict[str, Any] | None:
    """The choice as given. Only "none" changes anything (the reply is not read for calls); the
    gateway cannot force a call ("required", or one named tool), so those are taken as "auto"."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        if choice.get("name") not in names:
            raise RequestError("'tool_choice' names a tool that is not in 'tools'", "tool_choice")
        return choice
    raise RequestError(
        "'tool_choice' must be auto, none, required or {'type': 'function'|'custom', 'name'}", "tool_choice"
    )


def _messages(instructions: Any, raw: Any) -> list[Message]:
    """Chat messages (arguments as objects, call ids kept) for `instructions` and `input`."""
    messages: list[Message] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        if not raw:
            raise RequestError("'input' must not be empty", "input")
        return [*messages, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError("'input' must be a string or a non-empty array of input items", "input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind in _CALL_ITEMS:
            call = _call(item, kind, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in _OUTPUT_ITEMS:
            messages.append(
                {"role": "tool", "tool_call_id": _call_id(item, where), "content": _output(item.get("output"), where)}
            )
        elif kind == "reasoning":
            raise RequestError(
                f"{where}: reasoning items are not accepted: this gateway returns none, so this one is not its own",
                where,
            )
        elif kind == "item_reference":
            raise RequestError(
                f"{where}: item references need stored responses, which this gateway keeps none of", where
            )
        else:
            raise RequestError(f"{where}: input items of type {kind!r} are not supported", f"{where}.type")
    return messages


def _message(item: Mapping[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or an array of content parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}.content[{j}]: only input_text and output_text parts are supported (got {kind!r})",
                f"{where}.content[{j}]",
            )
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


def _call_id(item: Mapping[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
    return call_id


def _call(item: Mapping[str, Any], kind: str, where: str) -> Message:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
    if kind == "custom_tool_call":
        if not isinstance(item.get("input"), str):
            raise RequestError(f"{where}.input must be a string", f"{where}.input")
        arguments: Any = {CUSTOM_INPUT: item["input"]}
    else:
        raw = item.get("arguments")
        if not isinstance(raw, str):
            raise RequestError(f"{where}.arguments must be a JSON string", f"{where}.arguments")
        try:
            arguments = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as error:
            raise RequestError(f"{where}.arguments is not JSON: {error.msg}", f"{where}.arguments") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}.arguments must be a JSON object", f"{where}.arguments")
    return {"id": _call_id(item, where), "type": "function", "function": {"name": name, "arguments": arguments}}


def _output(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            if (
                not isinstance(part, dict)
                or part.get("type") not in _TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(f"{where}.output[{j}]: only text parts are supported", f"{where}.output[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.output must be a string or an array of text parts", f"{where}.output")


# Writing responses.


@dataclass(frozen=True)
class ResponseIds:
    """The response's id and creation time, fixed before its events are written."""

    id: str
    created_at: int

    @classmethod
    def new(cls) -> ResponseIds:
        return cls(f"resp_{secrets.token_hex(16)}", int(time.time()))


def output_items(
    result: CallResult, reply: Message, request: ResponsesRequest, tokenizer: ChatTokenizer
) -> list[dict[str, Any]]:
    """The reply as output items: a message (unless the reply is only tool calls), then one item per
    tool call, each carrying the session's id for the call as its call_id."""
    status = "incomplete" if result.generation.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if reply["content"] or not reply.get("tool_calls"):
        part: dict[str, Any] = {"type": "output_text", "text": reply["content"], "annotations": []}
        if request.logprobs:
            part["logprobs"] = chat_logprobs(result, tokenizer)["content"]
        items.append(
            {
                "id": f"msg_{secrets.token_hex(16)}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [part],
            }
        )
    for call in reply.get("tool_calls", ()):
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if (
            name in request.custom_tools
            and set(arguments) == {CUSTOM_INPUT}
            and isinstance(arguments[CUSTOM_INPUT], str)
        ):
            items.append(
                {
                    "id": f"ctc_{secrets.token_hex(16)}",
                    "type": "custom_tool_call",
                    "status": "completed",
                    "call_id": call["id"],
                    "name": name,
                    "input": arguments[CUSTOM_INPUT],
                }
            )
        else:
            items.append(
                {
                    "id": f"fc_{secrets.token_hex(16)}",
                    "type": "function_call",
                    "status": "completed",
                    "call_id": call["id"],
                    "name": name,
                    "arguments": json.dumps(arguments, ensure_ascii=False),
                }
            )
    return items


def response_object(
    ids: ResponseIds,
    model: str,
    rollout_id: str,
    request: ResponsesRequest,
    result: CallResult | None,
    output: list[dict[str, Any]],
) -> dict[str, Any]:
    """The response object; `result` None: the one response.created carries (in progress, no output)."""
    response: dict[str, Any] = {
        "id": ids.id,
        "object": "response",
        "created_at": ids.created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": output,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "usage": None,
        **request.echo,
    }
    if result is None:
        return response
    response["corral"] = {"rollout_id": rollout_id, "call_index": result.call_index}
    prompt, completion = len(result.prompt_ids), len(result.generation.output_ids)
    response["usage"] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
    if result.generation.finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    return response


def response_events(
    ids: ResponseIds,
    model: str,
    rollout_id: str,
    request: ResponsesRequest,
    result: CallResult,
    output: list[dict[str, Any]],
) -> Iterator[dict[str, Any]]:
    """The response as the Responses streaming events, in OpenAI's order: created, in_progress,
    each output item (added, its content or arguments as one delta, done), then completed (or
    incomplete when the reply was cut at max_output_tokens). Each has its sequence_number."""
    start = response_object(ids, model, rollout_id, request, None, [])
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for index, item in enumerate(output):
        events.extend(_item_events(index, item))
    final = response_object(ids, model, rollout_id, request, result, output)
    events.append({"type": f"response.{final['status']}", "response": final})
    for number, event in enumerate(events):
        yield {**event, "sequence_number": number}


def _item_events(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "message":
        yield {
            "type": "response.output_item.added",
            "output_index": index,
            "item": {**item, "status": "in_progress", "content": []},
        }
        for content_index, part in enumerate(item["content"]):
            empty = {**part, "text": "", **({"logprobs": []} if "logprobs" in part else {})}
            yield {"type": "response.content_part.added", **at, "content_index": content_index, "part": empty}
            yield {
                "type": "response.output_text.delta",
                **at,
                "content_index": content_index,
                "delta": part["text"],
                "logprobs": part.get("logprobs", []),
            }
            yield {
                "type": "response.output_text.done",
                **at,
                "content_index": content_index,
                "text": part["text"],
                "logprobs": part.get("logprobs", []),
            }
            yield {"type": "response.content_part.done", **at, "content_index": content_index, "part": part}
    elif item["type"] == "function_call":
        yield {
            "type": "response.output_item.added",
            "output_index": index,
            "item": {**item, "status": "in_progress", "arguments": ""},
        }
        yield {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]}
        yield {
            "type": "response.function_call_arguments.done",
            **at,
            "name": item["name"],
            "arguments": item["arguments"],
        }
    else:
        yield {
            "type": "response.output_item.added",
            "output_index": index,
            "item": {**item, "status": "in_progress", "input": ""},
        }
        yield {"type": "response.custom_tool_call_input.delta", **at, "delta": item["input"]}
        yield {"type": "response.custom_tool_call_input.done", **at, "input": item["input"]}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def sse_named_event(event: Mapping[str, Any]) -> bytes:
    """One Responses event: its type on the `event:` line, the whole event as `data:`."""
    payload = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {payload}\n\n".encode()
