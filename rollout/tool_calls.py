"""Tool calls in model output: parsing what the model wrote, and writing calls the same way (for
the replay policy and for prompts that show examples).

Two formats:
- HERMES: `<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>`, any number per
  turn, as Hermes and Qwen chat models write them.
- FENCED_BASH: a fenced ```bash block is one bash call; a line that is exactly `SUBMIT` (outside a
  block) is a submit call.
"""

from __future__ import annotations

import enum
import json
import re

from corral.rollout.types import ToolCall


class ToolCallFormat(str, enum.Enum):
    HERMES = "hermes"
    FENCED_BASH = "fenced_bash"


class ToolCallParseError(ValueError):
    """The output names a tool call that cannot be read; the message is shown to the model."""


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
_FENCED_BLOCK = re.compile(r"```(?:bash|sh)[ \t]*\n(.*?)```", re.DOTALL)
_SUBMIT_LINE = re.compile(r"^[ \t]*SUBMIT[ \t]*$", re.MULTILINE)


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> list[ToolCall]:
    """The tool calls in `text`, in order; [] when it has none. Raises ToolCallParseError when a
    call is there but malformed (so the model gets told, rather than the turn silently ending)."""
    if fmt is ToolCallFormat.HERMES:
        return _parse_hermes(text)
    return _parse_fenced_bash(text)


def render_tool_calls(calls: list[ToolCall], fmt: ToolCallFormat) -> str:
    """Text that `parse_tool_calls` reads back as `calls`."""
    if fmt is ToolCallFormat.HERMES:
        return "\n".join(
            f"{_HERMES_OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}</tool_call>"
            for call in calls
        )
    parts = []
    for call in calls:
        if call.name == "bash":
            command = str(call.arguments.get("command", ""))
            parts.append(f"```bash\n{command}{'' if command.endswith(chr(10)) else chr(10)}```")
        elif call.name == "submit":
            parts.append("SUBMIT")
        else:
            raise ValueError(f"the fenced-bash format has no way to write a {call.name!r} call")
    return "\n".join(parts)


def strip_tool_calls(text: str, fmt: ToolCallFormat) -> str:
    """`text` without the tool calls written in it (what `parse_tool_calls` reads), trimmed: the
    prose around them, as an OpenAI-style message's content."""
    if fmt is ToolCallFormat.HERMES:
        return _HERMES_CALL.sub("", text).strip()
    return _SUBMIT_LINE.sub("", _FENCED_BLOCK.sub("", text)).strip()


def _parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    for match in _HERMES_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as error:
            raise ToolCallParseError(
                f"the tool call is not valid JSON ({error.msg} at character {error.pos})"
            ) from None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise ToolCallParseError('a tool call must be a JSON object with a string "name"')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolCallParseError('"arguments" must be a JSON object') from None
        if not isinstance(arguments, dict):
            raise ToolCallParseError('"arguments" must be a JSON object')
        calls.append(ToolCall(payload["name"], arguments))
    if not calls and _HERMES_OPEN in text:
        raise ToolCallParseError("<tool_call> is not closed by </tool_call>")
    return calls


def _parse_fenced_bash(text: str) -> list[ToolCall]:
    calls = [ToolCall("bash", {"command": match.group(1)}) for match in _FENCED_BLOCK.finditer(text)]
    outside_blocks = _FENCED_BLOCK.sub("", text)
    if not calls and re.search(r"```(?:bash|sh)", outside_blocks):
        raise ToolCallParseError("the ```bash block is not closed by ```")
    if _SUBMIT_LINE.search(outside_blocks):
        calls.append(ToolCall("submit", {}))
    return calls
