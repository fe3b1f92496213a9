"""Prompt field substitution, the one rule tasks and the replay policy share.

`{name}` in a message content is replaced by `fields[name]`; `{{` and `}}` stand for literal
braces. A `{` or `}` that is neither doubled nor part of a `{name}` placeholder stays as it is, so
prompts that show JSON or code need no escaping unless the text inside braces looks like a name.
Names are letters, digits, `_`, `.` and `-`, not starting with a digit, `.` or `-`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_.\-]*)\}")


class MissingPromptField(KeyError):
    """A `{name}` placeholder names a field the task does not define."""

    def __init__(self, name: str) -> None:
        # args[0] is the whole message (KeyError would otherwise show just the quoted name).
        super().__init__(f"the prompt uses {{{name}}} but the task's prompt fields have no {name!r}")
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])


def fill_prompt_fields(text: str, fields: Mapping[str, str]) -> str:
    """`text` with each `{name}` replaced by `fields[name]` and `{{`/`}}` turned into braces.
    Substituted values are inserted verbatim (braces in them are not interpreted again). Raises
    MissingPromptField for a placeholder whose name is not in `fields`."""

    def replace(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "{{":
            return "{"
        if token == "}}":
            return "}"
        name = match.group(1)
        if name not in fields:
            raise MissingPromptField(name)
        return str(fields[name])

    return _TOKEN.sub(replace, text)
