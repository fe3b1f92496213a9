"""Qwen Code's tools: `run_shell_command` {command}, `edit` {file_path, old_string, new_string}
and `write_file` {file_path, content}, with absolute paths; the task ends on a reply without
tool calls. The editor's insert and view have no tool of their own here: they run as the
equivalent shell command (rollout/reference/bash_calls.py)."""

from __future__ import annotations

import posixpath

from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.vocabularies import FINAL_TEXT
from corral.rollout.types import ToolCall


class QwenVocabulary:
    name = "qwen"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | list[ToolCall] | str:
        if call.name == "submit":
            return FINAL_TEXT
        arguments = call.arguments
        if call.name == "editor" and arguments.get("command") in ("str_replace", "create"):
            path = posixpath.join(workdir, str(arguments.get("path", "")))
            if arguments["command"] == "create":
                return ToolCall("write_file", {"file_path": path, "content": str(arguments.get("file_text", ""))})
            # Its edit refuses a file not read in the session: read it in the same reply, first.
            edit = {
                "file_path": path,
                "old_string": str(arguments.get("old_str", "")),
                "new_string": str(arguments.get("new_str", "")),
            }
            return [ToolCall("read_file", {"file_path": path}), ToolCall("edit", edit)]
        # `submit` is answered above: the submit command is never used.
        command = as_bash_call(call, submit_command="true").arguments["command"]
        return ToolCall("run_shell_command", {"command": command})


VOCABULARY = QwenVocabulary()
