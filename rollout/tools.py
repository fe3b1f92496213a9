"""The agent's tools, run in one sandbox through the SDK: bash (a persistent shell session),
python (an IPython kernel), editor (file view and edits) and submit.

What the agent did wrong (an unknown tool, bad arguments, a missing file, a failing command) comes
back as observation text, because the model can learn from it; only a sandbox or backend that is
gone raises `SandboxFailure`, because then the rollout says nothing about the model.

`tool_instructions` writes the system-prompt text that describes the enabled tools, from the same
table (`TOOL_SPECS`) the argument checks use, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from corral.rollout.tool_calls import ToolCallFormat
from corral.rollout.types import SandboxFailure, ToolCall, ToolResult
from corral.sdk import errors as sdk_errors
from corral.sdk.ansi import strip_ansi
from corral.sdk.client import AsyncKernel, AsyncSandbox, AsyncShell

SHELL_NAME = "agent"
# Lines of context shown around an edit, so the agent sees what it changed.
_SNIPPET_CONTEXT_LINES = 3


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    # JSON-schema "properties" of the arguments, and which are required.
    parameters: Mapping[str, Mapping[str, Any]]
    required: tuple[str, ...] = ()

    def schema(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {
                "type": "object",
                "properties": {k: dict(v) for k, v in self.parameters.items()},
                "required": list(self.required),
            },
        }


TOOL_SPECS: Mapping[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec(
            "bash",
            "Run a bash command in a persistent shell session: the working directory, variables "
            "and functions carry over between calls. Returns the output (stdout and stderr "
            "interleaved) and the exit code when it is not 0.",
            {"command": {"type": "string", "description": "The bash command(s) to run."}},
            ("command",),
        ),
        ToolSpec(
            "python",
            "Run Python code in a persistent IPython kernel: variables and imports carry over "
            "between calls. Returns what the code printed, the value of its last expression and "
            "the traceback if it raised.",
            {"code": {"type": "string", "description": "The Python code to run."}},
            ("code",),
        ),
        ToolSpec(
            "editor",
            "View, create and edit files. Relative paths are relative to the working directory. "
            "`view` shows a file with line numbers (or lists a directory); `create` writes "
            "`file_text` to a file; `str_replace` replaces `old_str`, which must occur exactly "
            "once, by `new_str`; `insert` inserts `new_str` after line `insert_line` (0: at "
            "the top).",
            {
                "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
                "path": {"type": "string", "description": "The file or directory."},
                "file_text": {"type": "string", "description": "create: the whole content of the file."},
                "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
                "new_str": {"type": "string", "description": "str_replace, insert: the new text."},
                "insert_line": {"type": "integer", "description": "insert: the line after which to insert."},
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "view: [first, last] line, 1-based; last -1 means the end.",
                },
            },
            ("command", "path"),
        ),
        ToolSpec("submit", "End the episode: call it once the task is done. Nothing runs after it.", {}),
    )
}

_JSON_TYPES: Mapping[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "array": (list,)}


def tool_instructions(tools: Iterable[str], fmt: ToolCallFormat) -> str:
    """The text appended to the system prompt: the enabled tools and how to call them.

    The fenced-bash format can only express bash and submit, so other tools are left out of it.
    """
    enabled = set(tools)
    specs = [spec for name, spec in TOOL_SPECS.items() if name in enabled]
    if fmt is ToolCallFormat.FENCED_BASH:
        lines = ["# Tools", ""]
        if "bash" in enabled:
            lines += [
                "To run a bash command, write it in a fenced block:",
                "```bash",
                "ls -la",
                "```",
                "Each block runs in the same persistent shell session (the working directory and "
                "variables carry over); its output comes back in the next message.",
            ]
        if "submit" in enabled:
            lines += ["When the task is done, write a line containing only SUBMIT (outside any block)."]
        return "\n".join(lines)
    # Worded as Qwen's and Hermes' templates word it, which their models were trained on.
    lines = [
        "# Tools",
        "",
        "You may call one or more functions. The function signatures are within <tools></tools> XML tags:",
        "<tools>",
        *(json.dumps({"type": "function", "function": spec.schema()}, ensure_ascii=False) for spec in specs),
        "</tools>",
        "",
        "For each function call, write a JSON object with the function name and its arguments within "
        "<tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
        "The results come back in the next message.",
    ]
    if "submit" in enabled:
        lines.append("Call submit when the task is done.")
    return "\n".join(lines)


def format_reminder(fmt: ToolCallFormat) -> str:
    """One sentence telling the model how to call a tool (for replies the parser cannot use)."""
    if fmt is ToolCallFormat.FENCED_BASH:
        return "Run a command by writing it in a ```bash block; write SUBMIT alone on a line when the task is done."
    return (
        'Call a tool by writing <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>; '
        "call submit when the task is done."
    )


def cut_middle(text: str, limit: int, already_cut: int = 0) -> str:
    """`text` in at most `limit` UTF-8 bytes: when longer, its head and tail with a marker saying
    how many bytes were cut between them (`already_cut`: bytes the daemon already dropped there).

    Not `output.HeadTailBuffer`: that one streams bytes and joins head and tail without a marker;
    here a whole string is cut once and the marker must sit at the cut.
    """
    data = text.encode(errors="replace")  # lone surrogates (from JSON escapes) become "?"
    if len(data) <= limit and not already_cut:
        return data.decode()
    budget = max(limit - len(_marker(len(data) + already_cut)), 0)
    head_bytes = budget // 2
    tail_bytes = budget - head_bytes
    head = data[:head_bytes].decode(errors="ignore")  # a character cut in two is dropped whole
    tail = data[len(data) - tail_bytes :].decode(errors="ignore") if tail_bytes else ""
    cut = len(data) - len(head.encode()) - len(tail.encode()) + already_cut
    return head + _marker(cut) + tail


def _marker(cut: int) -> str:
    return f"\n[... {cut} bytes cut ...]\n"


class _AgentError(Exception):
    """A mistake of the agent's, reported to it as the observation."""


class SandboxToolBox:
    """The ToolBox of one rollout: runs the enabled tools in `sandbox`.

    The shell session and the kernel are opened on first use (most episodes use one of them) and
    closed by `close()`. Observations longer than `max_observation_bytes` are cut in the middle.
    """

    def __init__(
        self, sandbox: AsyncSandbox, tools: Iterable[str], *, workdir: str, max_observation_bytes: int
    ) -> None:
        self.sandbox = sandbox
        self.tools = frozenset(tools)
        unknown = self.tools - TOOL_SPECS.keys()
        if unknown:
            raise ValueError(f"unknown tools {sorted(unknown)}; known: {sorted(TOOL_SPECS)}")
        self.workdir = workdir
        self.max_observation_bytes = max_observation_bytes
        self._shell: AsyncShell | None = None
        self._kernel: AsyncKernel | None = None

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        try:
            if call.name not in self.tools:
                enabled = ", ".join(sorted(self.tools)) or "none"
                raise _AgentError(f"there is no tool {call.name!r} (tools: {enabled})")
            if call.name == "submit":  # whatever arguments came with it: the agent is done
                return ToolResult("Submitted.", submitted=True)
            arguments = _checked_arguments(TOOL_SPECS[call.name], call.arguments)
            run = {"bash": self._bash, "python": self._python, "editor": self._editor}[call.name]
            text = await run(arguments, timeout_s)
        except _AgentError as error:
            text = f"Error: {error}"
        return ToolResult(self._cut(text))

    async def close(self) -> None:
        """Closes the shell session and the kernel this toolbox opened; best effort (the sandbox
        may already be gone)."""
        shell, kernel, self._shell, self._kernel = self._shell, self._kernel, None, None
        for close in (shell.close if shell else None, kernel.shutdown if kernel else None):
            if close is None:
                continue
            try:
                await close()
            except sdk_errors.CorralError:
                pass

    def _cut(self, text: str, already_cut: int = 0) -> str:
        return cut_middle(text, self.max_observation_bytes, already_cut)

    # --- bash ------------------------------------------------------------------------------------

    async def _bash(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        async with self._sdk_errors("bash"):
            if self._shell is None:
                self._shell = await self.sandbox.shell(SHELL_NAME, cwd=self.workdir)
            # Twice the observation cap: the daemon keeps head and tail halves as big as what the
            # observation keeps, and `output_total_bytes` says how much it dropped.
            result = await self._shell.run(
                arguments["command"], timeout=timeout_s, strip_ansi=True, output_limit=2 * self.max_observation_bytes
            )
        output = result.output_plain if result.output_plain is not None else result.output
        notes = []
        if result.shell_restarted:
            notes.append("[the shell was restarted: working directory and variables are reset]")
        if result.timed_out:
            notes.append(f"[timed out after {timeout_s:g} s: the command was interrupted; the shell is still usable]")
        elif result.exit_code != 0:
            notes.append(f"[exit code: {result.exit_code}]")
        text = output.decode(errors="replace")
        text = "\n".join(([text.rstrip("\n")] if text else []) + notes) if notes else (text or "(no output)")
        already_cut = max(result.output_total_bytes - len(result.output), 0) if result.truncated else 0
        return self._cut(text, already_cut)

    # --- python ----------------------------------------------------------------------------------

    async def _python(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        async with self._sdk_errors("python"):
            if self._kernel is None:
                self._kernel = await self.sandbox.kernel(cwd=self.workdir)
            result = await self._kernel.execute(arguments["code"], timeout=timeout_s)
            if result.kernel_died:
                await self._kernel.restart()
        parts = [result.stdout, result.stderr]
        for display in result.displays:
            plain = display.get("text/plain")
            parts.append(
                plain.decode(errors="replace") + "\n"
                if plain is not None
                else f"[display: {', '.join(sorted(display))}]\n"
            )
        if result.result_text is not None:
            parts.append(result.result_text + "\n")
        if result.error is not None:
            parts.append(strip_ansi("\n".join(result.error.traceback).encode()).decode(errors="replace") + "\n")
        if result.timed_out:
            parts.append(f"[timed out after {timeout_s:g} s: the cell was interrupted; the kernel is still usable]\n")
        if result.kernel_died:
            parts.append("[the kernel died and was restarted: all variables are lost]\n")
        if result.restarted:
            parts.insert(
                0,
                f"[the kernel had died ({result.restart_reason}) and was restarted before this code ran: "
                "variables and imports from earlier calls are lost]\n",
            )
        return "".join(parts).rstrip("\n") or "(no output)"

    # --- editor ----------------------------------------------------------------------------------

    async def _editor(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        command, path = arguments["command"], self._absolute(arguments["path"])
        required = {
            "view": (),
            "create": ("file_text",),
            "str_replace": ("old_str",),
            "insert": ("insert_line", "new_str"),
        }[command]  # the spec's enum checked it
        missing = [name for name in required if name not in arguments]
        if missing:
            raise _AgentError(f"editor {command} needs {', '.join(missing)}")
        if command == "view":
            return await self._view(path, arguments.get("view_range"))
        if command == "create":
            await self._write(path, arguments["file_text"])
            return f"Created {path}."
        text = await self._read_text(path)
        if command == "str_replace":
            old, new = arguments["old_str"], arguments.get("new_str", "")
            if not old:
                raise _AgentError("old_str is empty")
            count = text.count(old)
            if count != 1:
                where = "does not occur" if count == 0 else f"occurs {count} times"
                raise _AgentError(
                    f"no replacement: old_str {where} in {path}; it must occur exactly once"
                    + (" (add surrounding lines to make it unique)" if count else "")
                )
            at = text.index(old)
            edited = text[:at] + new + text[at + len(old) :]
            await self._write(path, edited)
            first = text.count("\n", 0, at) + 1
            return f"Edited {path}:\n" + _numbered(
                edited, first - _SNIPPET_CONTEXT_LINES, first + new.count("\n") + _SNIPPET_CONTEXT_LINES
            )
        lines = text.splitlines(keepends=True)
        after = arguments["insert_line"]
        if not 0 <= after <= len(lines):
            raise _AgentError(f"insert_line {after} is outside the file (0 to {len(lines)})")
        insert = arguments["new_str"]
        if after and not lines[after - 1].endswith("\n"):
            lines[after - 1] += "\n"
        lines.insert(after, insert if insert.endswith("\n") else insert + "\n")
        await self._write(path, "".join(lines))
        return f"Edited {path}:\n" + _numbered(
            "".join(lines), after + 1 - _SNIPPET_CONTEXT_LINES, after + 1 + insert.count("\n") + _SNIPPET_CONTEXT_LINES
        )

    async def _view(self, path: str, view_range: Any) -> str:
        try:
            async with self._sdk_errors("editor"):
                data = await self.sandbox.read_file(path)
        except _AgentError as read_error:
            # Reading a directory fails; listing it is what `view` means for one.
            try:
                async with self._sdk_errors("editor"):
                    entries = await self.sandbox.list_dir(path)
            except _AgentError:
                raise read_error from None
            names = [entry.name + ("/" if entry.is_dir else "") for entry in entries]
            return f"{path} (directory):\n" + ("\n".join(names) if names else "(empty)")
        text = data.decode(errors="replace")
        if view_range is None:
            return _numbered(text, 1, None) or "(empty file)"
        if len(view_range) != 2 or not all(isinstance(n, int) for n in view_range):
            raise _AgentError("view_range must be two line numbers [first, last]")
        first, last = view_range
        count = len(text.splitlines())
        if not 1 <= first <= max(count, 1) or (last != -1 and not first <= last):
            raise _AgentError(f"view_range {view_range} does not fit the file's {count} lines")
        return _numbered(text, first, None if last == -1 else last)

    async def _read_text(self, path: str) -> str:
        async with self._sdk_errors("editor"):
            data = await self.sandbox.read_file(path)
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise _AgentError(f"{path} is not UTF-8 text; the editor cannot change it") from None

    async def _write(self, path: str, text: str) -> None:
        async with self._sdk_errors("editor"):
            await self.sandbox.write_file(path, text)

    def _absolute(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    # --- errors ----------------------------------------------------------------------------------

    def _sdk_errors(self, tool: str) -> _SdkErrors:
        return _SdkErrors(self, tool)


class _SdkErrors:
    """Sorts SDK errors: the agent's (a bad path, a file too big, no ipykernel in the image) become
    `_AgentError`; a sandbox, daemon or backend that is gone becomes `SandboxFailure`.

    NOT_FOUND means a missing file or a missing sandbox (or shell), so the sandbox is asked for.
    """

    _AGENT_ERRORS = (
        sdk_errors.InvalidArgument,
        sdk_errors.PermissionDenied,
        sdk_errors.ResourceExhausted,
        sdk_errors.FailedPrecondition,
        sdk_errors.AlreadyExists,
    )

    def __init__(self, toolbox: SandboxToolBox, tool: str) -> None:
        self.toolbox, self.tool = toolbox, tool

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: Any) -> None:
        if not isinstance(exc, sdk_errors.CorralError):
            return
        if isinstance(exc, self._AGENT_ERRORS):
            raise _AgentError(exc.details) from exc
        if isinstance(exc, sdk_errors.NotFound):
            sandbox = self.toolbox.sandbox
            try:
                await sandbox.refresh()
            except sdk_errors.CorralError as gone:
                raise SandboxFailure(f"sandbox {sandbox.id} is gone ({self.tool}): {gone}") from exc
            if self.tool == "bash":
                self.toolbox._shell = None  # its session is gone: the next command opens a new one
                raise _AgentError(
                    f"the shell session ended ({exc.details}); the next command starts a new one"
                ) from exc
            if self.tool == "python":
                self.toolbox._kernel = None
                raise _AgentError(f"the kernel is gone ({exc.details}); the next cell starts a new one") from exc
            raise _AgentError(exc.details) from exc
        raise SandboxFailure(f"sandbox {self.toolbox.sandbox.id} failed ({self.tool}): {exc}") from exc


def _checked_arguments(spec: ToolSpec, arguments: Mapping[str, Any]) -> Mapping[str, Any]:
    unknown = sorted(set(arguments) - spec.parameters.keys())
    if unknown:
        allowed = ", ".join(spec.parameters) or "none"
        raise _AgentError(f"{spec.name} has no argument {', '.join(map(repr, unknown))} (arguments: {allowed})")
    missing = [name for name in spec.required if name not in arguments]
    if missing:
        raise _AgentError(f"{spec.name} needs the argument {', '.join(map(repr, missing))}")
    for name, value in arguments.items():
        schema = spec.parameters[name]
        types_ = _JSON_TYPES.get(schema.get("type", ""), (object,))
        if not isinstance(value, types_) or isinstance(value, bool):
            raise _AgentError(f"{spec.name}: {name!r} must be a {schema['type']}")
        if "enum" in schema and value not in schema["enum"]:
            raise _AgentError(f"{spec.name}: {name!r} must be one of {', '.join(schema['enum'])}")
    return arguments


def _numbered(text: str, first: int, last: int | None) -> str:
    """Lines `first`..`last` (1-based, inclusive; None: to the end) with their numbers."""
    lines = text.splitlines()
    first = max(first, 1)
    last = len(lines) if last is None else min(last, len(lines))
    return "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(first, last + 1))
