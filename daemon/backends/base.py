"""The one interface every backend implements: create sandboxes, start processes in them, give
file access, destroy them, and say what this node supports."""

from __future__ import annotations

import abc
import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..cgroups import CgroupGroup, LimitSupport
from ..fsaccess import SandboxFiles
from ..process import HostProcess
from .nsenter import HOST_ENV


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


RUN_DIR_IN_SANDBOX = "/run/corral"


def run_dir_base(daemon_id: str) -> Path:
    """Where the daemon keeps per-sandbox run directories on the host. Short on purpose: kernel
    sockets live there and Unix socket paths are limited to 107 bytes."""
    root = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    return Path(root) / f"corral-{daemon_id}"


@dataclass(frozen=True)
class EnterCommand:
    """A host command line that runs a program inside a sandbox, and where it must start."""

    argv: list[str]
    cgroup: "CgroupGroup | None"  # the leaf cgroup the host process must join (see process.in_cgroup)
    cwd: str  # host-side working directory for the spawn
    # True when the spawned host process stays outside as the parent of the program (nsenter
    # forking into a pid namespace); False when it becomes the program itself.
    wrapped: bool = True
    # The environment to spawn argv with: the program's own environment is set inside.
    env: dict[str, str] = field(default_factory=lambda: dict(HOST_ENV))


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
    # The run directory (kernel sockets and other daemon<->sandbox rendezvous files), as the host
    # sees it and as the sandbox sees it. Unix socket paths must stay short: see run_dir_base().
    run_dir_host: str
    run_dir_sandbox: str

    @abc.abstractmethod
    def enter_command(self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str]) -> EnterCommand:
        """The host command that runs argv inside the sandbox as its user, with environment `env`,
        in leaf cgroup `leaf`. Spawn it with `EnterCommand.env`, never with `env`."""

    def start_process(
        self, argv: Sequence[str], *, env: dict[str, str], cwd: str, stdin: bytes | AsyncIterable[bytes] | None
    ) -> HostProcess:
        """Starts argv inside the sandbox with pipes, in a fresh process group and leaf cgroup."""
        enter = self.enter_command(argv, cwd=cwd, leaf=self.next_leaf("p"), env=env)
        return HostProcess(enter.argv, env=enter.env, stdin=stdin, cgroup=enter.cgroup, cwd=enter.cwd)

    def next_leaf(self, prefix: str) -> str:
        """A fresh leaf cgroup name, unique within the sandbox."""
        self._leaf_counter = getattr(self, "_leaf_counter", 0) + 1
        return f"{prefix}{self._leaf_counter}"

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


async def remove_sandbox_dirs(record: dict, sandboxes_dir: Path, run_base: Path) -> None:
    """Removes the workspace and run directories a sandbox record names (only where they should
    be: a damaged record must not point the daemon at other directories)."""
    for key, parent in (("sandbox_dir", sandboxes_dir), ("run_dir", run_base)):
        path = record.get(key)
        if path and Path(path).parent == parent:
            await asyncio.to_thread(shutil.rmtree, path, True)


class EnteredSandbox(SandboxRuntime):
    """What sandboxes entered through their init process share: liveness, shell, file access."""

    init_pid: int = 0
    _shell: str = "/bin/sh"

    def alive(self) -> bool:
        return bool(self.init_pid) and os.path.exists(f"/proc/{self.init_pid}")

    def shell_argv(self, script: str) -> list[str]:
        return [self._shell, "-c", script]

    def open_files(self, uid: int, max_bytes: int) -> None:
        """File access through the init's root; also picks bash as the shell where there is one."""
        self.files = SandboxFiles(f"/proc/{self.init_pid}/root", self.workdir, uid, uid, max_bytes)
        try:
            self.files.kind("/bin/bash")
            self._shell = "/bin/bash"
        except Exception:  # noqa: BLE001 - no bash (or no answer): /bin/sh
            pass
