"""The coding CLIs (Codex CLI, Claude Code, Gemini CLI, Qwen Code, Pi) as harness tasks: each CLI
runs inside the task's sandbox in its non-interactive mode, talks to the rollout's LLM gateway
session in its own API (`rollout/gateway`), and edits the task's files with its own tools.

Each CLI has a module here, registered in `_MODULES`, defining `CLI`, a `CodingCli`: its npm
package and pinned version, the binary it installs, the gateway API it speaks, the replay
policy's vocabulary for its tools (`rollout/reference/vocabularies`), and `parts(prefix)`: the
command, environment and configuration files that run it headless against the gateway with its
approval prompts, telemetry and update checks off. `prefix` is the npm prefix the CLIs were
installed into, as the sandbox sees it (read-only).

`with_coding_cli(task, name, prefix)` makes any task a harness task run by that CLI.
`python -m corral.rollout.coding_clis install [--prefix DIR] [NAME ...]` installs them (install.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from corral.v1 import rollout_pb2 as pb


@dataclass(frozen=True)
class HarnessParts:
    """What runs one CLI in a sandbox: its argv (run directly: the task's prompt is in
    $CORRAL_TASK_PROMPT, the gateway in the harness variables of rollout/harness.py), variables
    added to the harness's environment, and files written before it starts (sandbox path ->
    content: its configuration)."""

    command: list[str]
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class CodingCli:
    name: str
    package: str  # npm package
    version: str  # pinned: the version the tests ran
    binary: str  # the command it installs (PREFIX/node_modules/.bin/BINARY)
    api: str  # the gateway API it speaks: "chat", "responses", "messages" or "gemini"
    vocabulary: str  # the replay policy's vocabulary for its tools
    parts: Callable[[str], HarnessParts]
    # npm packages whose install scripts must run (all others are held back: install.py), e.g. a
    # postinstall that puts the CLI's native binary in place.
    install_scripts: tuple[str, ...] = ()

    @property
    def npm_spec(self) -> str:
        return f"{self.package}@{self.version}"

    def binary_path(self, prefix: str) -> str:
        return f"{prefix.rstrip('/')}/node_modules/.bin/{self.binary}"


# name -> module defining CLI (imported on first use).
_MODULES: dict[str, str] = {
    "claude": "corral.rollout.coding_clis.claude",
    "codex": "corral.rollout.coding_clis.codex",
    "gemini": "corral.rollout.coding_clis.gemini",
    "pi": "corral.rollout.coding_clis.pi",
    "qwen": "corral.rollout.coding_clis.qwen",
}


def names() -> list[str]:
    return sorted(_MODULES)


def coding_cli(name: str) -> CodingCli:
    """The CLI called `name`; ValueError naming the known ones otherwise."""
    module = _MODULES.get(name)
    if module is None:
        raise ValueError(f"unknown coding CLI {name!r} (known: {', '.join(names()) or 'none'})")
    cli: CodingCli = importlib.import_module(module).CLI
    return cli


def with_coding_cli(
    task: pb.Task,
    name: str,
    prefix: str,
    *,
    history_policy: pb.HistoryPolicy = pb.HISTORY_POLICY_UNSPECIFIED,
) -> pb.Task:
    """A copy of `task` run by the coding CLI `name` inside its sandbox (installed under `prefix`
    as the sandbox sees it); its configuration files join the task's setup files."""
    parts = coding_cli(name).parts(prefix)
    harnessed = pb.Task()
    harnessed.CopyFrom(task)
    harnessed.harness.Clear()
    harnessed.harness.command.extend(parts.command)
    harnessed.harness.env.update(parts.env)
    harnessed.harness.place = pb.HARNESS_PLACE_SANDBOX
    harnessed.harness.history_policy = history_policy
    for path, content in parts.files.items():
        harnessed.setup.files.add(path=path, content=content)
    return harnessed
