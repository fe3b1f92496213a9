"""Gemini CLI's tools (as its functionDeclarations name them in 0.61): `run_shell_command`
{command}, `replace` {file_path (absolute), instruction, old_string, new_string} and
`write_file` {file_path, content}; the task ends on a reply without tool calls.

The editor's str_replace and create use the CLI's own edit tools (`replace` wants the one
occurrence `old_string` names, as the editor does, and an `instruction` saying what the change is
for); insert and view, which its tools do not express the editor's way, and plain bash calls run
as shell commands (bash_calls' forms).
"""

from __future__ import annotations

import posixpath

from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.vocabularies import FINAL_TEXT
from corral.rollout.types import ToolCall


class GeminiCliVocabulary:
    name = "gemini"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | str:
        if call.name == "submit":
            return FINAL_TEXT
        arguments = call.arguments
        if call.name == "editor" and arguments.get("command") in ("str_replace", "create"):
            try:
                path = posixpath.join(workdir, str(arguments["path"]))
                if arguments["command"] == "create":
                    return ToolCall("write_file", {"file_path": path, "content": str(arguments["file_text"])})
                return ToolCall(
                    "replace",
                    {
                        "file_path": path,
                        "instruction": f"Apply the reference fix to {arguments['path']}.",
                        "old_string": str(arguments["old_str"]),
                        "new_string": str(arguments.get("new_str", "")),
                    },
                )
            except KeyError as error:
                raise ValueError(f"the editor call's arguments are incomplete: {error}") from None
        # Past this point `submit` is handled, so the bash form never needs a submit command.
        command = as_bash_call(call, submit_command="").arguments["command"]
        return ToolCall("run_shell_command", {"command": command})


VOCABULARY = GeminiCliVocabulary()
