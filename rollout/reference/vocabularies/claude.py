"""Claude Code's tools for the replay policy: `bash` is its `Bash` {command}; the editor's
str_replace is its `Edit` {file_path (absolute), old_string, new_string, replace_all} and create
its `Write` {file_path, content}; insert and view, which Claude Code's tools do not do as corral's
editor does, are `Bash` running the editor's program (rollout/reference/bash_calls.py); `submit`
is a reply without tool calls, which ends Claude Code's task.

Edit's arguments are written as Claude Code sends them back in the history: it fills in its tools'
defaults and puts them first (`replace_all: false`, then the rest). An Edit call without it would
come back changed (the next call would not extend the recorded sample: a split), and one with it
elsewhere would come back reordered (it extends the sample, but the history re-rendered differs
from the recorded ids: a splice).
"""

from __future__ import annotations

import posixpath

from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.vocabularies import FINAL_TEXT
from corral.rollout.types import ToolCall


class ClaudeCodeTools:
    name = "claude"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | str:
        if call.name == "submit":
            return FINAL_TEXT
        command = call.arguments.get("command")
        if call.name == "editor" and command in ("str_replace", "create"):
            path = posixpath.join(workdir, str(call.arguments.get("path", "")))
            if command == "create":
                return ToolCall("Write", {"file_path": path, "content": str(call.arguments.get("file_text", ""))})
            return ToolCall(
                "Edit",
                {
                    "replace_all": False,
                    "file_path": path,
                    "old_string": str(call.arguments.get("old_str", "")),
                    "new_string": str(call.arguments.get("new_str", "")),
                },
            )
        bash = as_bash_call(call, submit_command="")  # submit was answered above
        return ToolCall("Bash", {"command": bash.arguments["command"]})


VOCABULARY = ClaudeCodeTools()
