"""Pi's tools: `bash` {command}, `edit` {path, edits: [{oldText, newText}]} and `write` {path,
content}, paths relative to the directory Pi runs in (the workdir, as the editor's are); the task
ends on a reply without tool calls. The editor's insert and view have no tool of their own here:
they run as the equivalent shell command (rollout/reference/bash_calls.py)."""

from __future__ import annotations

from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.vocabularies import FINAL_TEXT
from corral.rollout.types import ToolCall


class PiVocabulary:
    name = "pi"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | list[ToolCall] | str:
        if call.name == "submit":
            return FINAL_TEXT
        arguments = call.arguments
        if call.name == "editor" and arguments.get("command") == "create":
            return ToolCall(
                "write", {"path": str(arguments.get("path", "")), "content": str(arguments.get("file_text", ""))}
            )
        if call.name == "editor" and arguments.get("command") == "str_replace":
            edit = {"oldText": str(arguments.get("old_str", "")), "newText": str(arguments.get("new_str", ""))}
            return ToolCall("edit", {"path": str(arguments.get("path", "")), "edits": [edit]})
        # `submit` is answered above: the submit command is never used.
        return ToolCall("bash", {"command": as_bash_call(call, submit_command="true").arguments["command"]})


VOCABULARY = PiVocabulary()
