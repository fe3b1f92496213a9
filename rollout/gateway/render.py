"""OpenAI chat requests into chat-template messages and token ids.

`normalize_messages` reads an OpenAI `messages` array into one canonical form, so that two
spellings of the same conversation (content None or "", a list of text parts or a string, tool-call
arguments as a JSON string with any spacing or as an object) compare equal:

    {"role": str, "content": str}
    + "tool_calls": [{"type": "function", "function": {"name": str, "arguments": dict}}] (assistant)
    + "tool_call_id": str (tool), "name": str (when given)

Tool-call ids are dropped: they are labels between the harness and itself, never shown to the
model by the byte template (a Hugging Face template that wants them gets them from the tool
messages' tool_call_id).

`ChatRenderer` turns a `Conversation` (normalized messages + the request's `tools`) into ids with
the session's ChatTokenizer. A Hugging Face tokenizer gets tool calls and `tools` through its own
chat template. The byte tokenizer's ChatML template knows no tools, so they are written into the
text, deterministically (the same request renders the same ids every time): an assistant message's
tool calls follow its content in the session's tool-call format, and the tools' JSON schemas are
appended to the system message (one is put first when there is none) in a Hermes-style block.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from corral.rollout.gateway.errors import RequestError
from corral.rollout.tokenizer import HFChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, render_tool_calls
from corral.rollout.types import ChatTokenizer, ToolCall

Message = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool")
# Roles other APIs spell differently, read as ours.
ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class Conversation:
    """What one chat call asks the model to continue: normalized messages and tool specs."""

    messages: tuple[Message, ...]
    tools: tuple[Message, ...] = ()


def normalize_messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array of message objects", "messages")
    return tuple(_normalize_message(message, f"messages[{i}]") for i, message in enumerate(raw))


def normalize_tools(raw: Any) -> tuple[Message, ...]:
    """The request's `tools` (function specs), as given; [] or None: no tools."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(tool, dict) for tool in raw):
        raise RequestError("'tools' must be an array of tool objects", "tools")
    for i, tool in enumerate(raw):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}]")
    return tuple(raw)


def _normalize_message(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object", where)
    role = message.get("role")
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)} (got {message.get('role')!r})", where)
    normalized: Message = {"role": role, "content": _content_text(message.get("content"), f"{where}.content")}
    if role == "assistant" and message.get("tool_calls"):
        normalized["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise RequestError(f"{where}.tool_call_id must be a string", where)
        normalized["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str) and message["name"]:
        normalized["name"] = message["name"]
    return normalized


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise RequestError(f"{where}[{i}]: only text content parts are supported", where)
        return "".join(parts)
    raise RequestError(f"{where} must be a string, an array of text parts, or null", where)


def _normalize_tool_calls(calls: Any, where: str) -> list[Message]:
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be an array", where)
    normalized = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}[{i}] must have a function with a string name", where)
        arguments = function.get("arguments")
        if arguments is None or arguments == "":
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                raise RequestError(f"{where}[{i}].function.arguments is not JSON: {error.msg}", where) from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}[{i}].function.arguments must be a JSON object", where)
        entry: Message = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        call_id = call.get("id")
        if call_id is not None:
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{where}[{i}].id must be a non-empty string", where)
            entry["id"] = call_id
        normalized.append(entry)
    return normalized


def message_tool_calls(message: Mapping[str, Any]) -> list[ToolCall]:
    return [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]


def same_reply(recorded: Mapping[str, Any], sent: Mapping[str, Any]) -> bool:
    """Whether `sent` is the assistant reply `recorded` as a harness may send it back: the same
    tool calls (arguments compared as objects, so JSON spacing does not matter; each call's id,
    where the harness sends one, the id the gateway gave it), the same content up to surrounding
    whitespace (None and "" alike)."""
    if sent.get("role") != "assistant" or recorded["content"].strip() != sent["content"].strip():
        return False
    recorded_calls, sent_calls = recorded.get("tool_calls", []), sent.get("tool_calls", [])
    return len(recorded_calls) == len(sent_calls) and all(
        mine["function"] == theirs["function"] and theirs.get("id", mine.get("id")) == mine.get("id")
        for mine, theirs in zip(recorded_calls, sent_calls)
    )


# How to call, per format, after the tools' schemas.
_CALL_INSTRUCTIONS = {
    ToolCallFormat.HERMES: (
        "For each function call, write a JSON object with the function name and arguments within "
        '<tool_call></tool_call> tags:\n<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    ),
    ToolCallFormat.FENCED_BASH: "Run a command by writing it in a ```bash block.",
}


def tools_block(tools: Sequence[Mapping[str, Any]], fmt: ToolCallFormat) -> str:
    """The tools' schemas as the byte template shows them: one JSON object (keys sorted) per line
    inside <tools></tools>, then how to call them in the session's format."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False, sort_keys=True) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. "
        "The function signatures are within <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n\n{_CALL_INSTRUCTIONS[fmt]}"
    )


class ChatRenderer:
    """Conversations into ids with one ChatTokenizer (see the module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer, tool_call_format: ToolCallFormat = ToolCallFormat.HERMES) -> None:
        self.tokenizer = tokenizer
        self.tool_call_format = tool_call_format

    def encode_prompt(self, conversation: Conversation) -> list[int]:
        if isinstance(self.tokenizer, HFChatTokenizer):
            tokenizer, tools = self.tokenizer, list(conversation.tools) or None
            return _templated(lambda: tokenizer.encode_prompt(list(conversation.messages), tools=tools))
        return list(self.tokenizer.encode_prompt(self.template_messages(conversation.messages, conversation.tools)))

    def encode_continuation(
        self,
        history: Conversation,
        generated_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int]:
        """The ids after `generated_ids` (the reply that follows `history`) up to the next
        generation prompt, with `new_messages` in between."""
        if isinstance(self.tokenizer, HFChatTokenizer):
            tokenizer, tools = self.tokenizer, list(history.tools) or None
            return _templated(
                lambda: tokenizer.encode_continuation(
                    list(history.messages), generated_ids, list(new_messages), tools=tools
                )
            )
        return list(
            self.tokenizer.encode_continuation(
                self.template_messages(history.messages, history.tools),
                generated_ids,
                self.template_messages(new_messages, ()),
            )
        )

    def encode_text(self, text: str) -> list[int]:
        """Ids of raw text (a completions prompt), without added BOS tokens."""
        encode = getattr(self.tokenizer, "encode", None)
        if encode is None:
            raise RequestError("this gateway's tokenizer cannot encode a text prompt: send token ids", "prompt")
        return list(encode(text))

    def template_messages(self, messages: Sequence[Message], tools: Sequence[Message]) -> list[dict[str, str]]:
        """Role/content messages for a template that knows no tools."""
        chat = [{"role": m["role"], "content": self.text_of(m)} for m in messages]
        if tools:
            block = tools_block(tools, self.tool_call_format)
            if chat and chat[0]["role"] == "system":
                content = chat[0]["content"]
                chat[0] = {"role": "system", "content": f"{content}\n\n{block}" if content else block}
            else:
                chat.insert(0, {"role": "system", "content": block})
        return chat

    def text_of(self, message: Mapping[str, Any]) -> str:
        """A message's text with its tool calls written after the content in the session's format."""
        calls = message_tool_calls(message)
        if not calls:
            return str(message["content"])
        try:
            rendered = render_tool_calls(calls, self.tool_call_format)
        except ValueError as error:
            raise RequestError(f"an assistant message's tool calls cannot be written: {error}", "messages") from None
        return f"{message['content']}\n{rendered}" if message["content"] else rendered


def _templated(render: Callable[[], list[int]]) -> list[int]:
    """A Hugging Face chat template's rendering; its refusals (raise_exception in the template,
    e.g. roles that do not alternate) are the request's fault."""
    try:
        return render()
    except Exception as error:  # noqa: BLE001 - jinja2 templates fail with many exception types
        raise RequestError(f"the chat template cannot render these messages: {error}", "messages") from None
