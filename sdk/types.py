"""Typed, immutable results of SDK calls: plain Python values, never protobuf messages.

Enums travel as short lower-case strings ("local", "running", "namespaces", ...); an enum value
this SDK does not know (a newer daemon) reads as "unknown".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Union

from corral.sdk.errors import CommandExitError

BackendName = Literal["local", "docker", "singularity"]
SandboxState = Literal["starting", "running", "failed", "stopping", "unspecified", "unknown"]
IsolationLevel = Literal["none", "namespaces", "container", "unspecified", "unknown"]
LimitKind = Literal["memory", "pids", "cpu", "wall_clock", "network", "unspecified", "unknown"]
FileType = Literal["file", "directory", "symlink", "other", "unspecified", "unknown"]
OutputStreamName = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class ResourceLimits:
    """Limits in force; 0 means the daemon applies none beyond its defaults."""

    memory_bytes: int
    pids: int
    cpu_millicores: int


@dataclass(frozen=True)
class LimitStatus:
    """Whether one kind of limit is really enforced, how (`mechanism`), or why not (`reason`)."""

    kind: LimitKind
    enforced: bool
    mechanism: str
    reason: str


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    backend: str
    image: str
    state: SandboxState
    isolation: IsolationLevel
    limits: ResourceLimits
    limit_status: tuple[LimitStatus, ...]
    network: bool
    labels: Mapping[str, str]
    # The default cwd of commands, e.g. "/workspace".
    workdir: str
    created_at: datetime
    # Seconds without any call before the daemon destroys the sandbox; None: never.
    idle_timeout: float | None


@dataclass(frozen=True)
class ExecResult:
    """How a command ended, with its (possibly truncated) output as bytes."""

    # 128 + signal when killed by a signal, as a shell reports it.
    exit_code: int
    # The signal that killed the main process; 0 when it exited by itself.
    signal: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    oom_killed: bool
    # True when stdout or stderr was longer than the output limit; each then holds the first and
    # the last half of the limit.
    truncated: bool
    duration_ms: int
    stdout_total_bytes: int
    stderr_total_bytes: int

    @property
    def ok(self) -> bool:
        """The command exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8; undecodable bytes become U+FFFD."""
        return self.stdout.decode(errors="replace")

    def check(self) -> ExecResult:
        """Returns self when `ok`, else raises CommandExitError carrying this result."""
        if not self.ok:
            raise CommandExitError(self)
        return self


@dataclass(frozen=True)
class ExecStarted:
    """First event of a stream: the command is running. `pid` is daemon-side, for diagnostics."""

    pid: int


@dataclass(frozen=True)
class ExecOutput:
    """A piece of output, exactly as the command wrote it."""

    stream: OutputStreamName
    data: bytes


@dataclass(frozen=True)
class ExecKeepalive:
    """Sent after the requested interval without output, so idle streams stay visibly alive."""


@dataclass(frozen=True)
class ExecExited:
    """Last event of a stream: how the command ended (fields as in ExecResult)."""

    exit_code: int
    signal: int
    timed_out: bool
    oom_killed: bool
    # True when output beyond the output limit was not forwarded.
    truncated: bool
    duration_ms: int
    stdout_total_bytes: int
    stderr_total_bytes: int


ExecEvent = Union[ExecStarted, ExecOutput, ExecKeepalive, ExecExited]


@dataclass(frozen=True)
class FileEntry:
    """One entry of a directory inside a sandbox."""

    name: str
    # Absolute path inside the sandbox.
    path: str
    type: FileType
    size_bytes: int
    # Permission bits, e.g. 0o755.
    mode: int
    modified_at: datetime
    # For symlinks, the target as stored (unresolved); None otherwise.
    symlink_target: str | None

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"

    @property
    def is_file(self) -> bool:
        return self.type == "file"


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend works on this node, what isolation it gives and which limits it enforces."""

    backend: str
    available: bool
    # Why not, when unavailable; the tool it uses when available (e.g. "bubblewrap 0.8.0").
    detail: str
    isolation: IsolationLevel
    limits: tuple[LimitStatus, ...]


@dataclass(frozen=True)
class NodeInfo:
    version: str
    daemon_id: str
    default_backend: str
    backends: tuple[BackendStatus, ...]
    # "v1", "v2", "hybrid" or "none".
    cgroup_mode: str
    sandbox_count: int
