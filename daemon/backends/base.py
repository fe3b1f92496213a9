"""The one interface every backend implements, and the lifecycle they share.

A backend is one folder, daemon/backends/NAME/, whose backend.py holds a `Backend` subclass (what
the node supports, how to check an image, the sandbox class it makes, how to release leftovers of
a crashed run) with its `Settings` (its section of the configuration), and a `ManagedSandbox`
subclass (how to launch and shut down one sandbox, and how to enter it). `registry.py` lists them.
What more than one backend uses lives beside this file (storage.py, root.py, nsenter.py, ...).

The lifecycle around those hooks is written once, here:

- create: check the backend is available, check the image, take a uid, make the directories
  (workspace, run directory), the cgroup where the daemon owns it, launch, open file access;
  anything that fails on the way is torn down before the error propagates;
- destroy: kill every process, shut the sandbox down, close file access, remove the cgroup and
  the directories, give the uid back (idempotent);
- record and reap: a record names everything a restarted daemon must remove after a crash.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from corral.sdk.errors import FailedPrecondition

from .. import diskcap
from ..cgroups import CgroupDriver, CgroupGroup, LeafPool, LimitSupport
from ..fsaccess import SandboxFiles
from ..process import HostProcess
from ..uids import UidPool
from .nsenter import HOST_ENV


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 0
    pids: int = 0
    cpu_millicores: int = 0
    disk_bytes: int = 0


@dataclass(frozen=True)
class BindMount:
    """A host directory or file shown inside a sandbox (CreateSandbox's `mounts`), already checked
    against the daemon's allowed roots: `host_path` is absolute with symlinks resolved."""

    host_path: str
    sandbox_path: str
    read_only: bool = True


class CannotFork(FailedPrecondition):
    """A backend that cannot fork at all here (its kind, or its storage setting on this node):
    the one refusal ForkSandbox answers FAILED_PRECONDITION for, which a caller may remember
    until the node's configuration changes (a fork that failed otherwise is another code:
    ForkManager.fork)."""


@dataclass(frozen=True)
class ForkPoint:
    """A read-only copy of a sandbox's writable filesystem at the moment of a fork, which its
    children start from (ForkSandbox): where the backend keeps it, and the block of host ids its
    files carry (daemon/backends/storage.py)."""

    source_id: str
    path: str
    disk_base: int


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    image: str
    limits: Limits
    network: bool
    env: dict[str, str] = field(default_factory=dict)
    # Who programs run as inside by default (daemon/users.py): "" = the image's own user.
    user: str = ""
    mounts: tuple[BindMount, ...] = ()
    # Set for a fork's child: its writable filesystem starts as this copy of its parent's.
    fork: ForkPoint | None = None


RUN_DIR_IN_SANDBOX = "/run/corral"
# Pauses between teardowns of a sandbox whose start failed and whose first teardown left something.
DISCARD_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)

log = logging.getLogger(__name__)


def run_dir_base(daemon_id: str) -> Path:
    """Where the daemon keeps per-sandbox run directories on the host. Short on purpose: kernel
    sockets live there and Unix socket paths are limited to 107 bytes."""
    root = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    return Path(root) / f"corral-{daemon_id}"


@dataclass(frozen=True)
class BackendContext:
    """What the daemon gives every backend: the same shape for all of them."""

    name: str  # the name it serves under (its registry key, what records and the wire call it)
    daemon_id: str
    state_dir: Path
    run_base: Path
    cgroups: CgroupDriver
    uids: UidPool
    workdir: str  # the writable working directory inside sandboxes (sandbox.workdir)
    max_file_bytes: int  # the ReadFile/WriteFile cap (exec.max_file_bytes)
    # Host paths a sandbox that sees the host's root must not see (the daemon's state and socket).
    hidden_paths: tuple[str, ...]
    settings: Any  # the backend's own configuration section (its `Settings`)

    @property
    def sandboxes_dir(self) -> Path:
        """Per-sandbox directories (workspaces) on the host."""
        return self.state_dir / "sandboxes"


@dataclass(frozen=True)
class EnterCommand:
    """A host command line that runs a program inside a sandbox, and where it must start."""

    argv: list[str]
    cgroup: CgroupGroup | None  # the leaf cgroup the host process must join (see process.in_cgroup)
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
    limits: dict[str, LimitSupport]  # memory, pids, cpu, wall_clock, network, disk


# How every backend's probe begins the problem it reports when the daemon is not root, and what
# `corral doctor` says to do about it (Backend.fixes).
NOT_ROOT = "the daemon is not root"
FIX_ROOT = "run the daemon as root (it gives each sandbox its own uid and cgroup); see deploy/corral.service"
FIX_CGROUPS = (
    "give the daemon writable cgroups: run it as root, under systemd with Delegate=yes (deploy/corral.service)"
)


class SandboxRuntime(abc.ABC):
    """A live sandbox as the managers see it: how to run programs in it and reach its files."""

    isolation: str
    limits: dict[str, LimitSupport]
    workdir: str
    files: SandboxFiles | None
    cgroup: CgroupGroup | None
    # The run directory (kernel sockets and other daemon<->sandbox rendezvous files), as the host
    # sees it and as the sandbox sees it. Unix socket paths must stay short: see run_dir_base().
    run_dir_host: str
    run_dir_sandbox: str

    @abc.abstractmethod
    def enter_command(
        self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str], user: str = ""
    ) -> EnterCommand:
        """The host command that runs argv inside the sandbox as `user` (daemon/users.py; "": the
        sandbox's default user), with environment `env`, in leaf cgroup `leaf`. Spawn it with
        `EnterCommand.env`, never with `env`."""

    def start_process(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        stdin: bytes | AsyncIterable[bytes] | None,
        user: str = "",
    ) -> HostProcess:
        """Starts argv inside the sandbox as `user` (see enter_command) with pipes, in a fresh
        process group and a leaf cgroup of its own: one of the sandbox's idle command leaves,
        handed back when `run` ends."""
        leaves = self.command_leaves
        leaf = leaves.take()
        try:
            enter = self.enter_command(argv, cwd=cwd, leaf=leaf, env=env, user=user)
        except BaseException:
            leaves.give_back(leaf, None)  # (CgroupGroup.make leaves nothing when it fails)
            raise
        try:
            return HostProcess(
                enter.argv,
                env=enter.env,
                stdin=stdin,
                cgroup=enter.cgroup,
                cwd=enter.cwd,
                on_done=lambda: leaves.give_back(leaf, enter.cgroup),
            )
        except BaseException:
            leaves.give_back(leaf, enter.cgroup)
            raise

    @property
    def command_leaves(self) -> LeafPool:
        """The leaves short commands (Exec, ExecStream, transfers) run in, reused between them."""
        if getattr(self, "_command_leaves", None) is None:
            self._command_leaves = LeafPool(lambda: self.next_leaf("p"))
        return self._command_leaves

    def next_leaf(self, prefix: str) -> str:
        """A fresh leaf cgroup name, unique within the sandbox."""
        self._leaf_counter = getattr(self, "_leaf_counter", 0) + 1
        return f"{prefix}{self._leaf_counter}"

    def user_host_ids(self, user: str) -> tuple[int, int] | None:
        """The host uid and gid that inside `user` ("" = the default user) is, as files show it;
        None where the daemon cannot give files away (an unprivileged test backend)."""
        return None

    def host_id_block(self) -> tuple[int, int]:
        """The first host id and the count of the block that ids 0 .. count - 1 of the sandbox's
        own user namespace are (daemon/uids.py); (0, 0) where its programs run without one."""
        return 0, 0

    def home(self, user: str) -> str:
        """HOME for a call as `user` ("" = the default user): the user's home in the image's
        passwd, as `docker exec` sets it (so a SWE image's /root/.bashrc is ~/.bashrc), else the
        workdir (a uid the image does not name, or a home of "/")."""
        return self.workdir

    def private_dir(self, name: str, user: str) -> tuple[str, str]:
        """A directory of the run directory that only `user` may use (mode 0700), made or taken
        back: (its host path, its path in the sandbox). Kernels keep their connection file and
        sockets in one of their own."""
        host = Path(self.run_dir_host) / name
        host.mkdir(mode=0o700, exist_ok=True)
        if (ids := self.user_host_ids(user)) is not None:
            os.chown(host, *ids, follow_symlinks=False)
        return str(host), f"{self.run_dir_sandbox}/{name}"

    def file_access(self) -> SandboxFiles:
        """The sandbox's file access (it exists from the end of creation to destruction)."""
        if self.files is None:
            raise FailedPrecondition("the sandbox's files are not reachable (it is starting or stopping)")
        return self.files

    def disk_kills(self) -> int:
        """Times the daemon killed the sandbox's processes for writing past its disk cap (a
        watched cap: local/diskwatch.py); a command that sees it grow was among them."""
        return 0

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


class ManagedSandbox(SandboxRuntime):
    """A sandbox whose init is a process on this host, entered from the host: the lifecycle every
    backend shares. Subclasses implement `launch` and `shutdown` (and `enter_command`)."""

    isolation = "container"
    # Directories made in the sandbox directory besides `workspace`, owned by the sandbox's uid.
    extra_dirs: ClassVar[tuple[str, ...]] = ()
    # Their mode, and the sandbox directory's: nobody else may list or read them (bubblewrap and
    # engines, root without capabilities, still pass through: hence x for others).
    dir_mode: ClassVar[int] = 0o711
    # False where the sandbox lives in a cgroup someone else owns (a container engine's): the
    # daemon then only adds leaves under it and removes only those.
    owns_cgroup: ClassVar[bool] = True
    # True where everything the sandbox can write lies in its sandbox directory (and the daemon's
    # mounts reach the processes that bind it): the directory then gets a size-capped filesystem
    # of its own (diskcap.py, limits.disk_bytes).
    caps_disk: ClassVar[bool] = False

    def __init__(self, backend: Backend, spec: SandboxSpec, uid: int) -> None:
        self.backend = backend
        self.context = backend.context
        self.spec = spec
        self.uid = uid
        self.gid = uid  # each sandbox user is its own group
        self.workdir = self.context.workdir
        self.limits = backend.status().limits
        self.sandbox_dir = self.context.sandboxes_dir / spec.sandbox_id
        self.run_dir = self.context.run_base / spec.sandbox_id
        self.run_dir_host = str(self.run_dir)
        self.run_dir_sandbox = RUN_DIR_IN_SANDBOX
        self.cgroup: CgroupGroup | None = None
        self.files: SandboxFiles | None = None
        self.init_pid = 0
        self._shell = "/bin/sh"
        self._released = False

    @property
    def workspace(self) -> Path:
        """The host directory mounted read-write at the workdir."""
        return self.sandbox_dir / "workspace"

    # -- the lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Directories, cgroup, launch, file access. On failure the caller destroys the sandbox."""
        await self._make_dirs()
        if self.owns_cgroup and self.context.cgroups.can_track:
            limits = self.spec.limits
            try:
                self.cgroup = self.context.cgroups.create(
                    self.spec.sandbox_id, limits.memory_bytes, limits.pids, limits.cpu_millicores
                )
            except OSError as err:
                raise FailedPrecondition(f"cannot apply the sandbox's limits: {err.strerror} ({err.filename})") from err
        await self.launch()
        if self.files is None:
            self.files = self.make_file_access()
        self._pick_shell()

    async def _make_dirs(self) -> None:
        self.sandbox_dir.mkdir(parents=True, exist_ok=True)
        await self.mount_writable()
        for sub in ("workspace", *self.extra_dirs):
            path = self.sandbox_dir / sub
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, self.uid, self.gid)
            os.chmod(path, self.dir_mode)
        os.chmod(self.sandbox_dir, self.dir_mode)
        self.sandbox_dir.parent.chmod(0o711)
        # The run directory: the default user's, searchable (not listable) by the sandbox's other
        # users, whose shells read their files there and whose kernels have private_dir()s in it.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.run_dir, self.uid, self.gid)
        os.chmod(self.run_dir, 0o711)

    async def mount_writable(self) -> None:
        """Mounts the sandbox's own writable filesystem at its (empty) directory: a size-capped one
        (diskcap.py) where the backend caps disk and the sandbox has a cap, else nothing (the
        directory stays on the state directory's disk)."""
        disk_kind = self.backend.disk_kind
        if self.caps_disk and disk_kind and self.spec.limits.disk_bytes:
            # (A failure is the node's: a full state disk is RESOURCE_EXHAUSTED, see node_error.)
            await diskcap.mount_capped(disk_kind, self.sandbox_dir, self.spec.limits.disk_bytes)

    async def destroy(self) -> None:
        await self.kill_processes()
        await self.shutdown()
        if self.files:
            self.files.close()
            self.files = None
        if self.cgroup and self.owns_cgroup:
            await asyncio.to_thread(self.cgroup.remove)
        await asyncio.to_thread(diskcap.unmount, self.sandbox_dir)
        await asyncio.to_thread(shutil.rmtree, self.sandbox_dir, True)
        await asyncio.to_thread(shutil.rmtree, self.run_dir, True)
        if not self._released:
            self._released = True
            self.context.uids.give_back(self.uid)

    def record(self) -> dict:
        return {
            **self.backend.placeholder_record(self.spec.sandbox_id),
            **self.record_extra(),
        }

    # -- hooks --------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def launch(self) -> None:
        """Starts the sandbox's init (and sets `init_pid`); the directories and cgroup exist."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stops what `launch` started (after its processes were killed). Idempotent, and safe
        after a launch that failed half-way."""

    def record_extra(self) -> dict:
        """Backend-specific record fields (a launcher pid, a container id, an instance name)."""
        return {}

    async def kill_processes(self) -> None:
        """Kills every process of the sandbox: its whole cgroup where the daemon owns it."""
        if self.cgroup:
            await asyncio.to_thread(self.cgroup.kill)

    def make_file_access(self) -> SandboxFiles:
        """File access through the init's root, as the sandbox's uid."""
        return SandboxFiles(
            f"/proc/{self.init_pid}/root", self.workdir, self.uid, self.uid, self.context.max_file_bytes
        )

    def _pick_shell(self) -> None:
        # bash where the image has it, else /bin/sh.
        try:
            assert self.files is not None
            self.files.kind("/bin/bash")
            self._shell = "/bin/bash"
        except Exception:  # noqa: BLE001 - no bash (or no answer): /bin/sh
            self._shell = "/bin/sh"

    # -- running programs ---------------------------------------------------------------------------

    def alive(self) -> bool:
        return bool(self.init_pid) and os.path.exists(f"/proc/{self.init_pid}")

    def shell_argv(self, script: str) -> list[str]:
        return [self._shell, "-c", script]


class Backend(abc.ABC):
    """One kind of sandbox. Every backend is built the same way, `Backend(context)`."""

    name: str  # the registry key; an instance takes the name its context gives
    # The dataclass of the backend's configuration section ([name] in the TOML file). Its
    # `validate()` raises ValueError naming the key.
    Settings: ClassVar[type]
    sandbox_class: ClassVar[type[ManagedSandbox]]

    def __init__(self, context: BackendContext) -> None:
        self.name = context.name
        self.context = context
        self.settings = context.settings
        # The kind of per-sandbox filesystem this node can mount (diskcap.probe; "" where none).
        self.disk_kind, self.disk_support = diskcap.probe(context.sandboxes_dir)
        self._status = self.probe()
        self._teardowns: set[asyncio.Task] = set()  # retried teardowns of failed starts

    # -- what the node supports ---------------------------------------------------------------------

    @abc.abstractmethod
    def probe(self) -> BackendStatus:
        """Whether this backend works on this node, and what it enforces (run once at start)."""

    def status(self) -> BackendStatus:
        return self._status

    @classmethod
    def fixes(cls, status: BackendStatus) -> list[str]:
        """What to do about the parts of this backend that `status` reports missing or second
        best, in the words `corral doctor` prints: running as root first, then the backend's own
        (`own_fixes`), then writable cgroups when a limit lacks them. `status` is this backend's
        probe, here or in a running daemon (GetNodeInfo), so only what it says counts."""
        found = [FIX_ROOT] if NOT_ROOT in status.detail else []
        found += cls.own_fixes(status)
        if FIX_ROOT not in found and any(
            not limit.enforced and "cgroup" in limit.reason for limit in status.limits.values()
        ):
            found.append(FIX_CGROUPS)
        return found

    @classmethod
    def own_fixes(cls, status: BackendStatus) -> list[str]:
        """The fixes for what only this backend needs (its tools, its engine), from the problems
        its `probe` names in `status.detail`."""
        return []

    @abc.abstractmethod
    def default_image(self) -> str:
        """The image of requests that name none ("" when this node configures none)."""

    async def cached_images(self) -> list[str]:
        """The images this backend holds ready on the node, where that is cheap to list (none by
        default)."""
        return []

    # -- the lifecycle ------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        """Creates a sandbox and returns once it can run commands; leaves nothing behind when it
        fails."""
        await self.ensure_available()
        await self.check_image(spec.image)
        uid = self.context.uids.take()
        try:
            sandbox = self.new_sandbox(spec, uid)
        except BaseException:
            self.context.uids.give_back(uid)
            raise
        try:
            await sandbox.start()
        except BaseException:
            await self._discard(sandbox)
            raise
        return sandbox

    def new_sandbox(self, spec: SandboxSpec, uid: int) -> ManagedSandbox:
        """The sandbox object a create starts (`sandbox_class`, unless the backend picks another
        kind for how this node runs it)."""
        return self.sandbox_class(self, spec, uid)

    async def _discard(self, sandbox: ManagedSandbox) -> None:
        """Destroys a sandbox whose start failed. When the node is short of what the teardown
        needs too (no file descriptors left: often the very reason the start failed), what is left
        is torn down again in the background until it is gone."""
        try:
            await sandbox.destroy()
            if not sandbox.sandbox_dir.exists():
                return
        except Exception as err:
            log.warning(
                "tearing down sandbox %s after its failed start: %s; retrying",
                sandbox.spec.sandbox_id,
                err,
                exc_info=True,
            )
        task = asyncio.get_running_loop().create_task(self._retry_destroy(sandbox))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def _retry_destroy(self, sandbox: ManagedSandbox) -> None:
        for delay in DISCARD_RETRY_DELAYS_S:
            await asyncio.sleep(delay)
            try:
                await sandbox.destroy()
            except Exception as err:
                log.warning("tearing down sandbox %s again: %s", sandbox.spec.sandbox_id, err, exc_info=True)
                continue
            if not sandbox.sandbox_dir.exists():
                return
        log.error(
            "sandbox %s could not be torn down after its failed start; %s is left",
            sandbox.spec.sandbox_id,
            sandbox.sandbox_dir,
        )

    async def ensure_available(self) -> None:
        """Raises when this backend cannot make sandboxes now."""
        if not self._status.available:
            raise FailedPrecondition(f"the {self.name} backend cannot make sandboxes here: {self._status.detail}")

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        """Freezes a copy of a running sandbox's writable filesystem for ForkSandbox's children
        (spec.fork); the sandbox is paused at most for the instant the copy takes."""
        raise CannotFork(
            f'the {self.name} backend cannot fork sandboxes (local can with local.storage = "btrfs", '
            "docker on its btrfs pool, the default where the node has one, and singularity)"
        )

    async def keep_snapshot(self, sandbox: SandboxRuntime, name: str) -> tuple[ForkPoint, int]:
        """A fork point kept under `name` (a named snapshot, removed by drop_fork_point) and the
        bytes it holds; RESOURCE_EXHAUSTED past the backend's store for them."""
        raise FailedPrecondition(
            f'the {self.name} backend cannot snapshot sandboxes (local can with local.storage = "btrfs", '
            "docker on its btrfs pool, the default where the node has one, and singularity)"
        )

    async def drop_fork_point(self, point: ForkPoint) -> None:  # noqa: B027 - an optional hook
        """Removes a fork point once its children exist (they do not need it) or failed."""

    async def check_image(self, image: str) -> None:  # noqa: B027 - an optional hook
        """Raises InvalidArgument/NotFound for an image this backend cannot start."""

    def placeholder_record(self, sandbox_id: str) -> dict:
        """The record saved before a sandbox starts: enough for a restarted daemon to remove a
        sandbox whose creation was cut short."""
        return {
            "backend": self.name,
            "sandbox_id": sandbox_id,
            "sandbox_dir": str(self.context.sandboxes_dir / sandbox_id),
            "run_dir": str(self.context.run_base / sandbox_id),
        }

    async def reap(self, record: dict) -> None:
        """Removes the leftovers of a sandbox from a previous daemon run (see record())."""
        await self.release(record)
        await self.context.cgroups.remove_group(record.get("sandbox_id", ""))
        await remove_sandbox_dirs(record, self.context.sandboxes_dir, self.context.run_base)

    async def release(self, record: dict) -> None:  # noqa: B027 - an optional hook
        """Stops what a crashed daemon's sandbox left running (its launcher, container or
        instance), from its record."""

    async def reap_orphans(self) -> None:  # noqa: B027 - an optional hook
        """At start, after every record was reaped: removes leftovers no record mentions."""

    async def close(self) -> None:  # noqa: B027 - an optional hook
        """Releases what the backend holds (clients, pools)."""


async def remove_sandbox_dirs(record: dict, sandboxes_dir: Path, run_base: Path) -> None:
    """Removes the workspace and run directories a sandbox record names (only where they should
    be: a damaged record must not point the daemon at other directories)."""
    for key, parent in (("sandbox_dir", sandboxes_dir), ("run_dir", run_base)):
        path = record.get(key)
        if path and Path(path).parent == parent:
            await asyncio.to_thread(diskcap.unmount, Path(path))
            await asyncio.to_thread(shutil.rmtree, path, True)
