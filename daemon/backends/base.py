"""The one interface every backend implements: create sandboxes, start processes in them, give
file access, destroy them, and say what this node supports."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterable, Sequence
from dataclasses import dataclass, field

from ..cgroups import LimitSupport
from ..fsaccess import SandboxFiles
from ..process import HostProcess


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 0
    pids: int = 0
    cpu_millicores: int = 0


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    image: str
    limits: Limits
    network: bool
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendStatus:
    available: bool
    detail: str
    isolation: str  # none | namespaces | container
    limits: dict[str, LimitSupport]  # memory, pids, cpu, wall_clock, network


class SandboxRuntime(abc.ABC):
    """A live sandbox as its backend sees it."""

    isolation: str
    limits: dict[str, LimitSupport]
    workdir: str
    files: SandboxFiles

    @abc.abstractmethod
    def start_process(
        self, argv: Sequence[str], *, env: dict[str, str], cwd: str, stdin: bytes | AsyncIterable[bytes] | None
    ) -> HostProcess:
        """Starts argv inside the sandbox, in a fresh process group and leaf cgroup."""

    @abc.abstractmethod
    def shell_argv(self, script: str) -> list[str]:
        """argv that runs a shell string with the sandbox's shell."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the sandbox's init has died."""

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Kills every process and removes everything the sandbox left on the host. Idempotent."""

    @abc.abstractmethod
    def record(self) -> dict:
        """What a restarted daemon needs to find and remove this sandbox's leftovers."""


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def status(self) -> BackendStatus:
        """Whether this backend works on this node, and what it enforces."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        """Creates a sandbox and returns once it can run commands."""

    @abc.abstractmethod
    async def reap(self, record: dict) -> None:
        """Removes the leftovers of a sandbox from a previous daemon run (see SandboxRuntime.record)."""

    async def reap_orphans(self) -> None:
        """At start, after every record was reaped: removes leftovers no record mentions."""

    async def close(self) -> None:
        """Releases what the backend holds (clients, pools)."""
