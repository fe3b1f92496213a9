"""Codex CLI's tools (rollout/coding_clis/codex.py): `exec_command` {cmd} runs a shell command,
`apply_patch` (a custom tool whose input is Codex's patch text) edits files, and the task ends on a
reply without tool calls.

- bash {command} -> exec_command {cmd: command}.
- editor str_replace whose old_str and new_str are whole lines (old_str ends with a newline, new_str
  is empty or ends with one) -> apply_patch updating those lines: the lines of old_str removed, the
  lines of new_str added, in one hunk without context. Codex's apply_patch finds hunks by whole
  lines, so an edit of part of a line cannot be one: it, and every other editor command, runs as
  the equivalent shell command (rollout/reference/bash_calls.py) through exec_command.
- editor create whose file_text ends with a newline (or is empty) -> apply_patch adding the file.
- submit -> the final text.

The custom tool's input travels in the call's one argument `input`, which is how the gateway shows
a custom tool to the model and reads its calls back (rollout/gateway/responses_api.py).
"""

from __future__ import annotations

from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.vocabularies import FINAL_TEXT
from corral.rollout.types import ToolCall

SHELL = "exec_command"
PATCH = "apply_patch"


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=False) if text else []


def _whole_lines(text: str) -> bool:
    return text == "" or text.endswith("\n")


def _patch(body: str) -> ToolCall:
    return ToolCall(PATCH, {"input": f"*** Begin Patch\n{body}*** End Patch"})


def _as_patch(arguments: dict[str, object]) -> ToolCall | None:
    """The editor call as an apply_patch call, or None when the patch format cannot express it."""
    command, path = arguments.get("command"), arguments.get("path")
    if not isinstance(path, str) or not path or "\n" in path:
        return None
    if command == "str_replace":
        old, new = arguments.get("old_str"), arguments.get("new_str", "")
        if not isinstance(old, str) or not isinstance(new, str) or not old or not _whole_lines(old):
            return None
        if not _whole_lines(new):
            return None
        hunk = "".join(f"-{line}\n" for line in _lines(old)) + "".join(f"+{line}\n" for line in _lines(new))
        return _patch(f"*** Update File: {path}\n@@\n{hunk}")
    if command == "create":
        text = arguments.get("file_text")
        if not isinstance(text, str) or not _whole_lines(text):
            return None
        return _patch(f"*** Add File: {path}\n" + "".join(f"+{line}\n" for line in _lines(text)))
    return None


class CodexVocabulary:
    name = "codex"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | str:
        if call.name == "submit":
            return FINAL_TEXT
        if call.name == "editor":
            patch = _as_patch(call.arguments)
            if patch is not None:
                return patch
        # bash, and the editor commands a patch cannot express, as a shell command.
        command = as_bash_call(call, submit_command="true").arguments["command"]
        return ToolCall(SHELL, {"cmd": command})


VOCABULARY = CodexVocabulary()
