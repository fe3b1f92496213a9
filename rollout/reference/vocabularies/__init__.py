"""Tool vocabularies: how a harness's own tools express corral's reference solutions, so that the
replay policy can drive a harness that is not corral's agent loop (a coding CLI, mini-swe-agent)
through the LLM gateway and solve the bundled tasks with that harness's tools.

A reference solution is a list of corral tool calls (`bash` {command}, `editor` {command, path,
...}, `submit` {}). A vocabulary answers each with the call the harness's model would make (a
`ToolCall` in the harness's tool names and argument shapes, written by the replay policy in HERMES
markup, which the gateway turns into the API's own tool-call objects) or, for the final `submit`,
with plain text when the harness ends its task on a reply without tool calls (the coding CLIs do).

Each harness has its own module here, registered by name in `_MODULES`; `vocabulary(name)` loads
it. A module defines `VOCABULARY`, an object with `name` and `answer(call, workdir)`.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from corral.rollout.types import ToolCall

# The reply that ends a task for harnesses that stop when the model answers without a tool call.
FINAL_TEXT = "The fix is in place and the tests pass."


class Vocabulary(Protocol):
    name: str

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | list[ToolCall] | str:
        """The harness's call for the reference call `call` (`submit` {} past the solution's
        end), several calls made in one reply (a harness whose edit tool wants the file read
        first), or the text of a reply without tool calls. `workdir`: the directory the harness
        runs in, for tools that take absolute paths. ValueError when it cannot be expressed."""
        ...


# name -> module defining VOCABULARY (imported on first use).
_MODULES: dict[str, str] = {
    "claude": "corral.rollout.reference.vocabularies.claude",
    "codex": "corral.rollout.reference.vocabularies.codex",
    "gemini": "corral.rollout.reference.vocabularies.gemini",
    "pi": "corral.rollout.reference.vocabularies.pi",
    "qwen": "corral.rollout.reference.vocabularies.qwen",
}


def names() -> list[str]:
    return sorted(_MODULES)


def vocabulary(name: str) -> Vocabulary:
    """The vocabulary called `name`; ValueError naming the known ones otherwise."""
    module = _MODULES.get(name)
    if module is None:
        known = ", ".join(names()) or "none"
        raise ValueError(f"unknown tool vocabulary {name!r} (known: {known})")
    found: Vocabulary = importlib.import_module(module).VOCABULARY
    return found
