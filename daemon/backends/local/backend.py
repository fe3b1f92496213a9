"""The local backend: a sandbox is a set of Linux namespaces on the host, made by bubblewrap (or,
where it is missing, util-linux unshare + chroot; see launch.py).

Per sandbox the daemon keeps a directory on a size-capped filesystem of its own
(limits.disk_bytes, diskcap.py) with `workspace/` (mounted read-write at the workdir), `tmp/`
(mounted at /tmp) and the sandbox's root (root.py): the image through idmapped read-only
mounts under a writable overlay, in a user namespace of the sandbox's own that maps ids 0-65535
to its block of host ids (daemon/uids.py). /proc, /dev (a private writable /dev/shm included) and
/run are private. A container image (an archive, an OCI layout, an engine's image) is unpacked
once into a cached root filesystem directory first (images.py). The daemon's state
directory and socket directory are hidden behind empty tmpfs mounts.

A long-lived init process, host root without capabilities outside the sandbox's user namespace
(beyond the reach of everything inside), keeps the namespaces alive; commands enter them with
nsenter, the user namespace last, as the sandbox's default user (root unless CreateSandbox's
`user` says otherwise) or a call's `user`, in a leaf cgroup of the sandbox's cgroup. Every process
of a sandbox runs under a seccomp filter (daemon/seccomp.py) unless local.seccomp = "none". If
the daemon dies, the sandbox's pid 1 dies with it (bubblewrap: --die-with-parent; unshare: init's
stdin, held by the daemon, closes) and the kernel kills every process of the sandbox.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets as tokens
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

from ... import diskcap
from ...cgroups import LimitSupport
from ...fsaccess import PASSWD_MAX_BYTES, SandboxFiles, read_passwd
from ...process import in_cgroup, is_process, read_line
from ...seccomp import loader_argv, program, supported
from ...users import INSIDE_ID_COUNT, ROOT, SandboxUser, resolve_user
from .. import snapshot_store
from ..base import NOT_ROOT, Backend, BackendStatus, CannotFork, EnterCommand, ForkPoint, ManagedSandbox, SandboxRuntime
from ..nsenter import HOST_ENV, inside_env, nsenter_argv
from ..root import (
    INIT_READY,
    RootMount,
    build_root,
    kernel_support,
    make_mount_points,
    make_user_namespace,
    refusing_unbuildable,
    secrets,
    unmount_root,
)
from ..storage import (
    SnapshotStore,
    StoragePool,
    bind_subvolume,
    delete_subvolume,
    make_subvolume,
    node_pool,
    snapshot_paused,
)
from ..unprivileged import only_root, remove_tree, user_namespace_support
from . import nsprocs
from .diskwatch import DiskWatch, rootless_disk_support, sandbox_disk_support, usage_bytes, watcher_mechanism
from .forkcopy import check_room, copy_writable, has_reflinks, in_own_userns, in_sandbox_userns
from .images import ImageCache, parse_reference
from .launch import (
    bwrap_argv,
    bwrap_options,
    host_paths_over_own_mounts,
    init_pid,
    root_layout,
    unshare_argv,
)
from .rlimits import STAND_INS, SandboxRlimits
from .rootless import COPY, OVERLAY, TmpfsDisk, copy_layout, setup_argv, writable_root_kind

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
# Sandboxes whose root is being built and whose launcher is starting, at most, at once (the
# others wait their turn: see LocalSandbox._start_init). Each holds its slot for a few
# milliseconds unless its launcher hangs (START_TIMEOUT_S).
LAUNCH_SLOTS = 8
# What the probe says is missing, and what `corral doctor` says to do about it (own_fixes).
NO_NSENTER = "nsenter is not installed"
NO_BWRAP = "bubblewrap is not installed"
NO_LAUNCHER = "neither bubblewrap nor util-linux unshare and chroot are installed"
FIX_NSENTER = "apt-get install util-linux (for nsenter)"
FIX_BWRAP = "apt-get install bubblewrap"
FIX_BWRAP_OVER_UNSHARE = (
    "apt-get install bubblewrap, then restart the daemon: without it local sandboxes fall back to "
    "util-linux unshare + chroot (bubblewrap is the preferred launcher)"
)


def _version(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@dataclass
class LocalSettings:
    """The [local] configuration section."""

    isolation: str = "auto"  # auto | bwrap | unshare | none (docs/local-backend.md)
    allow_no_isolation: bool = False  # must be true for isolation = "none"
    # Host directories, beyond the operating system, that "host"-image sandboxes see read-only at
    # their own paths (docs/local-backend.md).
    host_paths: list[str] = field(default_factory=list)
    shm_bytes: int = 64 << 20  # the size of each sandbox's private /dev/shm
    # "default": every process of a sandbox runs under daemon/seccomp.py's filter; "none": no
    # filter (docs/local-backend.md).
    seccomp: str = "default"
    # Container images (docker-archive:, oci-archive:, oci:, docker: references) are unpacked once
    # into this directory ("": <state_dir>/images), least recently used ones removed past
    # image_cache_bytes (0: no limit); docker: names an image of the engine at engine_socket ("":
    # $DOCKER_HOST, else unix:///var/run/docker.sock) (docs/local-backend.md, "Container images").
    image_cache_dir: str = ""
    image_cache_bytes: int = 20 << 30
    engine_socket: str = ""
    # "capfs": each sandbox's writable space on a filesystem of its own (diskcap.py); "btrfs": a
    # subvolume of the node's btrfs pool, which ForkSandbox needs (storage.py), the pool
    # being an image of storage_bytes (0: the size of the state directory's disk, sparse).
    storage: str = "capfs"
    storage_bytes: int = 0
    # What named snapshots (SnapshotSandbox) may hold together, counted as the bytes each holds.
    snapshot_store_bytes: int = 64 << 30
    # A daemon without root caps a sandbox's disk with a size-capped tmpfs (memory) when its
    # limits.disk_bytes is at most this, else with a watcher that kills its processes past the
    # cap (docs/local-backend.md, "Limits without root"); 0: the watcher always.
    rootless_tmpfs_max_bytes: int = 1 << 30

    def validate(self) -> None:
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION_MODES)}")
        if self.isolation == "none" and not self.allow_no_isolation:
            raise ValueError('isolation = "none" requires local.allow_no_isolation = true')
        for path in self.host_paths:
            if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) == "/":
                raise ValueError(f"host_paths must hold absolute paths of directories other than /, got {path!r}")
        if self.shm_bytes < 1 << 20:
            raise ValueError("shm_bytes must be at least 1 MiB (1048576)")
        if self.seccomp not in SECCOMP_PROFILES:
            raise ValueError(f"seccomp must be one of {', '.join(SECCOMP_PROFILES)}")
        if self.image_cache_dir and not os.path.isabs(self.image_cache_dir):
            raise ValueError(f"image_cache_dir must be an absolute path, got {self.image_cache_dir!r}")
        if self.image_cache_bytes < 0:
            raise ValueError("image_cache_bytes must be 0 (no limit) or positive")
        if self.storage not in STORAGE_KINDS:
            raise ValueError(f"storage must be one of {', '.join(STORAGE_KINDS)}")
        if self.snapshot_store_bytes < 0:
            raise ValueError("snapshot_store_bytes must be 0 (no named snapshots) or positive")
        if self.storage_bytes < 0:
            raise ValueError("storage_bytes must be 0 (the state disk's size) or positive")
        if self.rootless_tmpfs_max_bytes < 0:
            raise ValueError("rootless_tmpfs_max_bytes must be 0 (no tmpfs: the watcher) or positive")


ISOLATION_MODES = ("auto", "bwrap", "unshare", "none")
SECCOMP_PROFILES = ("default", "none")
STORAGE_KINDS = ("capfs", "btrfs")


class LocalSandbox(ManagedSandbox):
    isolation = "namespaces"
    extra_dirs = ("tmp",)  # mounted at /tmp
    # Its root's writable layer, workspace and /tmp are all it can write (besides its
    # size-capped /dev/shm).
    caps_disk = True

    backend: LocalBackend

    def __init__(self, backend: LocalBackend, spec, uid: int) -> None:
        super().__init__(backend, spec, uid)
        self.rootfs = backend.rootfs(spec.image)
        # A cached container image stays in the cache while the sandbox lives (images.py).
        self._image_hold = backend.images.hold(self.rootfs)
        self._launcher: subprocess.Popen | None = None
        # The sandbox's user namespace (a file descriptor of the daemon's) and its default user.
        self._userns_fd = -1
        self.user = ROOT
        # With the btrfs pool: the sandbox's subvolume, and the block of host ids its files carry
        # on disk (its own, or the first ancestor's for a fork's child; storage.py).
        self.subvolume: Path | None = None
        self.disk_base = uid
        if backend.launcher != "none":
            self.user = resolve_user(spec.user or "root", read_passwd(self.rootfs))

    def user_host_ids(self, user: str) -> tuple[int, int] | None:
        if self.isolation == "none":
            return self.uid, self.uid
        return self.host_ids(resolve_user(user, self._passwd()) if user else self.user)

    def host_id_block(self) -> tuple[int, int]:
        return (0, 0) if self.isolation == "none" else (self.uid, INSIDE_ID_COUNT)

    def home(self, user: str) -> str:
        if self.isolation == "none":
            return self.workdir
        return (resolve_user(user, self._passwd()) if user else self.user).home_or(self.workdir)

    def host_ids(self, user: SandboxUser) -> tuple[int, int]:
        """The host uid and gid an inside user is (the sandbox's id block, daemon/uids.py)."""
        return self.uid + user.uid, self.uid + user.gid

    async def _make_dirs(self) -> None:
        await super()._make_dirs()
        if self.backend.launcher == "none":
            return
        # The workspace is the default user's; /tmp everyone's, as on any system.
        host_uid, host_gid = self.host_ids(self.user)
        os.chown(self.workspace, host_uid, host_gid)
        os.chmod(self.workspace, 0o755)
        os.chown(self.sandbox_dir / "tmp", self.uid, self.uid)
        os.chmod(self.sandbox_dir / "tmp", 0o1777)
        os.chown(self.run_dir, host_uid, host_gid)

    async def mount_writable(self) -> None:
        pool = self.backend.pool
        if pool is None:
            await super().mount_writable()
        else:
            await asyncio.to_thread(self._mount_subvolume, pool)

    def _mount_subvolume(self, pool: StoragePool) -> None:
        """The sandbox's subvolume, new or a snapshot of its fork point, capped and bound at its
        directory (idmapped for a fork's child: the files keep the ids they have on disk)."""
        fork = self.spec.fork
        subvolume = make_subvolume(pool, self.spec.sandbox_id, fork.path if fork else "", self.spec.limits.disk_bytes)
        self.subvolume = subvolume
        if fork is not None:
            self.disk_base = fork.disk_base
            # Overlay's scratch space of the parent's mounts: a fresh mount wants it empty.
            for work in (subvolume / "layers" / "work").glob("*"):
                for entry in work.iterdir():
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        bind_subvolume(subvolume, self.sandbox_dir, self.disk_base, self.uid, INSIDE_ID_COUNT)

    async def launch(self) -> None:
        backend = self.backend
        if backend.launcher == "none":
            # No namespaces: commands run on the host as the sandbox's uid, in its workspace.
            self.isolation = "none"
            self.workdir = str(self.workspace)
            self.run_dir_sandbox = self.run_dir_host
            self.files = SandboxFiles("/", self.workdir, self.uid, self.uid, self.context.max_file_bytes)
            if self.spec.mounts:
                raise FailedPrecondition('host bind mounts need namespaces: local.isolation = "none" has none')
            return
        if self.rootfs != "/" and self._image_hold is None:  # (cached images are the daemon's own)
            await self._check_image_readable()
        layout = await asyncio.to_thread(self._layout)
        self._userns_fd = await asyncio.to_thread(make_user_namespace, self.uid)
        async with backend.launch_slots:
            await self._start_init(layout)
            # The init's mount namespace holds its own copy of the root now: the daemon's goes.
            await asyncio.to_thread(unmount_root, self.sandbox_dir)

    async def _start_init(self, layout: list[RootMount]) -> None:
        """Builds the root in the daemon's mount namespace and starts the launcher on it, until
        its init answers (or raises FailedPrecondition with what the launcher said).

        Every launcher copies the daemon's whole mount namespace (and drops the copy again at
        pivot_root), under a lock of the kernel that all of them share: a root left there for
        each sandbox, or built for each of many starting at once (a fork's children), makes n
        starts cost O(n^2) mount copies in series (a fork of 64 children spent seconds there).
        So the roots go once their init holds its copy (launch), and only LAUNCH_SLOTS starts
        at a time are here (LocalBackend.launch_slots)."""
        backend = self.backend
        with refusing_unbuildable(self.spec.image or "host"):
            root = await asyncio.to_thread(
                build_root,
                layout,
                self.sandbox_dir,
                self.uid,
                self._userns_fd,
                ("proc", "dev", "tmp", "run", self.workdir),
            )
        shm_bytes = backend.settings.shm_bytes
        mounts = self.spec.mounts
        if self.rootfs == "/":
            mounts = (*mounts, *host_paths_over_own_mounts(backend.host_paths, backend.hidden_paths))
        points = [(m.sandbox_path, os.path.isdir(m.host_path)) for m in mounts]
        await asyncio.to_thread(make_mount_points, root, points, self.uid)
        launch_args = (root, self.sandbox_dir, self.run_dir, self.workdir, self.spec.network, shm_bytes, mounts)
        pass_fds: list[int] = []
        if backend.launcher == "bwrap":
            assert backend.bwrap is not None  # the probe chose bwrap because it found it
            argv, pass_fds = self._bwrap_command(bwrap_argv(backend.bwrap, *launch_args))
        else:
            assert backend.unshare is not None  # the probe chose unshare because it found it
            argv = unshare_argv(backend.unshare, *launch_args, seccomp=backend.seccomp_program)
        init_cgroup = self.cgroup.leaf("init") if self.cgroup else None
        await self._spawn_launcher(in_cgroup(argv, init_cgroup), pass_fds)

    def _bwrap_command(self, argv: list[str]) -> tuple[list[str], list[int]]:
        """A bwrap command line with its options (and the seccomp filter) moved into memory files
        passed by descriptor, and those descriptors: bwrap stays the sandbox's pid 1, whose command
        line the sandbox can read, and its options name host paths."""
        pass_fds: list[int] = []
        options, argv = bwrap_options(argv)
        if self.backend.seccomp_program:
            pass_fds.append(_memfd("corral-seccomp", self.backend.seccomp_program))
            options += ["--seccomp", str(pass_fds[-1])]
        pass_fds.append(_memfd("corral-bwrap-args", b"\0".join(o.encode() for o in options) + b"\0"))
        return [argv[0], "--args", str(pass_fds[-1]), *argv[1:]], pass_fds

    async def _spawn_launcher(self, argv: list[str], pass_fds: list[int]) -> None:
        """Starts the launcher (closing `pass_fds` here) and waits until the sandbox's init says
        it is up; FailedPrecondition with what the launcher said otherwise."""
        backend = self.backend
        try:
            # Spawned from the event loop thread on purpose: nothing here may die with a worker.
            self._launcher = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
                cwd="/",
                start_new_session=True,
                pass_fds=pass_fds,
            )
        finally:
            for fd in pass_fds:
                os.close(fd)
        assert self._launcher.stdout is not None and self._launcher.stderr is not None
        ready = await read_line(self._launcher.stdout.fileno(), START_TIMEOUT_S)
        if ready != INIT_READY:
            said = await asyncio.to_thread(self._launcher.stderr.read)
            raise FailedPrecondition(
                f"{backend.launcher} could not start the sandbox: "
                f"{said.decode(errors='replace').strip() or 'no error output'}"
            )
        self.init_pid = init_pid(self._launcher.pid)

    def _layout(self) -> list[RootMount]:
        """What the sandbox's root is made of (a "host" one: the first asks for the host's secrets)."""
        backend = self.backend
        covered = backend.host_secrets if self.rootfs == "/" else []
        return root_layout(self.rootfs, backend.hidden_paths, backend.host_paths, covered)

    async def _check_image_readable(self) -> None:
        """The root binds the image's entries as root, which skips the search permission of the
        directories above it: a directory image is refused unless the sandbox's uid could reach and
        read it on the host itself (checked by the kernel, as that uid)."""
        check = await asyncio.create_subprocess_exec(
            *as_sandbox_user(self.uid),
            "/bin/sh",
            "-c",
            'test -r "$1" && test -x "$1"',
            "corral-check-image",
            self.rootfs,
            env=HOST_ENV,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if await check.wait() != 0:
            raise FailedPrecondition(
                f"local image {self.spec.image} is not readable by the sandbox's uid: it and every directory "
                "above it must be readable and searchable by other users (a sandbox may see only what its "
                "own uid could read on the host)"
            )

    async def shutdown(self) -> None:
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            for pipe in (launcher.stdin, launcher.stdout, launcher.stderr):
                if pipe is not None:
                    pipe.close()
            _kill(launcher.pid)
            await asyncio.to_thread(launcher.wait)
        if not os.path.ismount(self.sandbox_dir):
            # (On the sandbox's own filesystem, the root goes when destroy detaches that.)
            await asyncio.to_thread(unmount_root, self.sandbox_dir)
        if self._userns_fd >= 0:
            os.close(self._userns_fd)
            self._userns_fd = -1

    def _passwd(self) -> str:
        """The sandbox's /etc/passwd as it is now, read as its default user ("" if it has none)."""
        try:
            data, _, _ = self.file_access().read("/etc/passwd", 0, PASSWD_MAX_BYTES)
        except (NotFound, InvalidArgument, PermissionDenied):
            return ""
        return data.decode(errors="replace")

    def make_file_access(self) -> SandboxFiles:
        """File access through the init's root, as the default user's host ids."""
        host_uid, host_gid = self.host_ids(self.user)
        return SandboxFiles(
            f"/proc/{self.init_pid}/root", self.workdir, host_uid, host_gid, self.context.max_file_bytes
        )

    async def destroy(self) -> None:
        await super().destroy()
        if self.subvolume is not None:
            await asyncio.to_thread(delete_subvolume, self.subvolume)
            self.subvolume = None
        if self._image_hold is not None:
            self._image_hold.release()

    def record_extra(self) -> dict:
        return {"launcher_pid": self._launcher.pid if self._launcher else 0}

    def fork_point(self, point: Path) -> ForkPoint:
        """Pauses the sandbox (where its cgroup can be frozen), writes its filesystem out and
        snapshots its subvolume read-only at `point`, then resumes it."""
        assert self.subvolume is not None  # (only made with the pool)
        snapshot_paused(self.subvolume, point, lambda paused: bool(self.cgroup) and self.cgroup.freeze(paused))  # type: ignore[union-attr]
        return ForkPoint(self.spec.sandbox_id, str(point), self.disk_base)

    def alive(self) -> bool:
        if self.isolation == "none":
            return self.files is not None
        return self._launcher is not None and self._launcher.poll() is None

    def enter_command(
        self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str], user: str = ""
    ) -> EnterCommand:
        cgroup = self.cgroup.leaf(leaf) if self.cgroup else None
        # The filter comes first, on the host-side step that enters (see seccomp.ENTERING_NEEDS):
        # an entered process is the child of no process of the sandbox, so inherits nothing there.
        filtered = self.backend.seccomp_prefix
        if self.isolation == "none":
            drop = as_sandbox_user(self.uid)
            return EnterCommand([*filtered, *drop, *inside_env(argv, env)], cgroup, cwd or self.workdir, wrapped=False)
        assert self.backend.nsenter is not None
        who = self.user
        if user:
            # Against the sandbox's own passwd as it is now (read as the default user, in its root).
            who = resolve_user(user, self._passwd())
        enter = nsenter_argv(
            self.backend.nsenter,
            self.init_pid,
            who.uid,
            self.workdir,
            argv,
            cwd,
            env,
            gid=who.gid,
            user_namespace=f"/proc/{os.getpid()}/fd/{self._userns_fd}",
        )
        return EnterCommand([*filtered, *enter], cgroup, "/")


class RootlessSandbox(LocalSandbox):
    """A local sandbox of a daemon that is not root (rootless.py): one user namespace mapping root
    inside to the daemon's own ids, made with the mount namespace its root is built in, and no
    other id, so programs run as root inside only; the daemon's uid owns every file on the host."""

    def __init__(self, backend: LocalBackend, spec, uid: int) -> None:
        super().__init__(backend, spec, uid)
        self.user = self._inside_user(spec.user)
        limits = spec.limits
        # Its disk cap: a capped tmpfs where the node has one and the cap is small enough, else
        # watched (diskwatch.py), with RLIMIT_FSIZE per file besides.
        self.tmpfs_bytes = limits.disk_bytes if 0 < limits.disk_bytes <= backend.tmpfs_max_bytes else 0
        self.disk_watch: DiskWatch | None = None
        disk = sandbox_disk_support(self.tmpfs_bytes, self.limits["disk"], backend.disk_watcher)
        self.limits = {**self.limits, "disk": disk}
        # The rlimits standing in for the limits no cgroup holds (rlimits.py): set on the init by
        # the root setup step, and on every process that enters by a prefix.
        fsize = 0 if self.tmpfs_bytes else limits.disk_bytes
        self.rlimits = backend.rlimits.values(limits.memory_bytes, limits.pids, fsize)
        self.rlimit_prefix = backend.rlimits.prefix(self.rlimits)

    def _inside_user(self, user: str) -> SandboxUser:
        """`user` ("" = the default) as the sandbox knows it, refused unless it is root."""
        if not user:
            return self.user
        passwd = self._passwd() if self.files is not None else read_passwd(self.rootfs)
        return only_root(resolve_user(user, passwd), user, 'docs/local-backend.md, "Without root"')

    def user_host_ids(self, user: str) -> tuple[int, int] | None:
        self._inside_user(user)
        return os.getuid(), os.getgid()

    def host_id_block(self) -> tuple[int, int]:
        return os.getuid(), 1

    def host_ids(self, user: SandboxUser) -> tuple[int, int]:
        return os.getuid(), os.getgid()

    async def _make_dirs(self) -> None:
        # (Owned by the daemon's uid, which is root inside: nothing to give away.)
        self.sandbox_dir.mkdir(parents=True, exist_ok=True)
        self.sandbox_dir.parent.chmod(0o711)
        for sub, mode in (("workspace", 0o755), ("tmp", 0o1777), ("root", 0o755), ("layers", 0o700)):
            (self.sandbox_dir / sub).mkdir(exist_ok=True)
            os.chmod(self.sandbox_dir / sub, mode)
        os.chmod(self.sandbox_dir, self.dir_mode)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o711)

    async def launch(self) -> None:
        backend = self.backend
        assert backend.bwrap is not None  # the rootless probe needs bubblewrap
        if self.rootfs != "/" and self._image_hold is None and not os.access(self.rootfs, os.R_OK | os.X_OK):
            raise FailedPrecondition(
                f"local image {self.spec.image} is not readable by the daemon's user, whose uid its sandboxes run as"
            )
        # Masks over host secrets are not needed: root inside reads only what the daemon's uid may.
        layout = root_layout(self.rootfs, backend.hidden_paths, backend.host_paths)
        if backend.root_kind == COPY:
            layout = await asyncio.to_thread(copy_layout, layout, self.sandbox_dir / "image")
        mounts = self.spec.mounts
        if self.rootfs == "/":
            mounts = (*mounts, *host_paths_over_own_mounts(backend.host_paths, backend.hidden_paths))
        root, layers = self.sandbox_dir / "root", self.sandbox_dir / "layers"
        mountpoints = ("/proc", "/dev", "/tmp", "/run", self.workdir)
        fork = self.spec.fork
        disk = TmpfsDisk(self.tmpfs_bytes, fork.path if fork else "") if self.tmpfs_bytes else None
        if fork is not None and disk is None:
            # (An OS error, as a node's: a full state disk is RESOURCE_EXHAUSTED.)
            await asyncio.to_thread(
                copy_writable,
                in_own_userns(backend.unshare or "unshare"),
                Path(fork.path),
                self.sandbox_dir,
                self.writable_dirs(),
            )
        baseline = 0
        if self.spec.limits.disk_bytes and disk is None and backend.root_kind == COPY:
            # (The copied image is the root's writable layer: what it held at the start is not counted.)
            baseline = await asyncio.to_thread(
                usage_bytes, in_own_userns(backend.unshare or "unshare"), [str(self.sandbox_dir / "image")]
            )
        setup = setup_argv(sys.executable, root, layers, layout, mountpoints, self.rlimits, disk)
        launch_args = (
            root,
            self.sandbox_dir,
            self.run_dir,
            self.workdir,
            self.spec.network,
            backend.settings.shm_bytes,
        )
        argv, pass_fds = self._bwrap_command(bwrap_argv(backend.bwrap, *launch_args, mounts))
        init_cgroup = self.cgroup.leaf("init") if self.cgroup else None
        async with backend.launch_slots:
            try:
                await self._spawn_launcher(in_cgroup([*setup, *argv], init_cgroup), pass_fds)
            except FailedPrecondition as err:
                if disk is not None and os.strerror(errno.ENOSPC) in str(err):
                    # A fork point larger than the child's cap: the node's answer, not the request's.
                    raise diskcap.DiskCapError(errno.ENOSPC, f"the sandbox's disk cap: {err}") from err
                raise
        if self.spec.limits.disk_bytes and disk is None:
            self.disk_watch = DiskWatch(
                self.spec.sandbox_id,
                self.spec.limits.disk_bytes,
                self.in_userns(),
                self.writable_paths,
                lambda: self.init_pid,
                self.alive,
                baseline,
            )
            self.disk_watch.start()

    def writable_dirs(self) -> list[str]:
        """What the sandbox can write, as directories of its own: its root's writable layer (the
        overlays' upper directories, or the copied image), the root's own directory on a "host"
        root (a new top-level directory lies there, beside the overlays' mount points), the
        workspace and /tmp. What a fork copies and the watcher sums."""
        own = ["workspace", "tmp"]
        if self.backend.root_kind == COPY:
            return [*own, "root" if self.rootfs == "/" else "image"]
        return [*own, "layers/upper", *(["root"] if self.rootfs == "/" else [])]

    def writable_paths(self) -> list[str]:
        """writable_dirs as the daemon's user reaches them: through the setup step's mount
        namespace, in which a capped tmpfs covers the sandbox's directory."""
        return [f"{self.setup_view()}/{sub}" for sub in self.writable_dirs()]

    def setup_view(self) -> str:
        """The sandbox's directory as its launcher (bubblewrap's outer process, in the mount
        namespace the setup step made) sees it."""
        assert self._launcher is not None
        return f"/proc/{self._launcher.pid}/root{self.sandbox_dir}"

    def in_userns(self) -> list[str]:
        """The prefix that runs a host command in the sandbox's user namespace (forkcopy.py)."""
        assert self.backend.nsenter is not None  # (the probe requires it)
        return in_sandbox_userns(self.backend.nsenter, self.init_pid)

    def disk_kills(self) -> int:
        return self.disk_watch.kills if self.disk_watch else 0

    async def shutdown(self) -> None:
        if self.disk_watch is not None:
            await self.disk_watch.stop()
        await super().shutdown()

    def fork_point(self, point: Path) -> ForkPoint:
        """Pauses the sandbox (its cgroup frozen where one was delegated, else every process of it
        stopped: nsprocs.py), copies its root's writable layer, workspace and /tmp to `point`
        (reflinks where the filesystem has them), and resumes it. Nothing is left at `point` when
        the copy fails; RESOURCE_EXHAUSTED when it would not fit on the state directory's disk."""
        backend = self.backend
        if backend.root_kind == COPY:
            raise CannotFork(
                "forking sandboxes of a daemon without root needs the kernel's unprivileged overlayfs "
                '(docs/local-backend.md, "Without root")'
            )
        point.mkdir(mode=0o700)
        try:
            frozen = bool(self.cgroup) and self.cgroup.freeze(True)  # type: ignore[union-attr]
            stopped = [] if frozen else nsprocs.stop_all(self.init_pid)
            try:
                if not backend.reflinks:
                    check_room(usage_bytes(self.in_userns(), self.writable_paths()), point.parent)
                copy_writable(self.in_userns(), Path(self.setup_view()), point, self.writable_dirs())
            finally:
                if frozen:
                    self.cgroup.freeze(False)  # type: ignore[union-attr]
                nsprocs.resume(stopped)
        except BaseException:
            remove_tree(point)
            raise
        return ForkPoint(self.spec.sandbox_id, str(point), os.getuid())

    def make_file_access(self) -> SandboxFiles:
        """File access through the init's root as the daemon itself (its uid is root inside)."""
        return SandboxFiles(f"/proc/{self.init_pid}/root", self.workdir, None, None, self.context.max_file_bytes)

    async def destroy(self) -> None:
        await super().destroy()
        # What the daemon's user may not remove without first giving itself the permission.
        await asyncio.to_thread(remove_tree, self.sandbox_dir)

    def enter_command(
        self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str], user: str = ""
    ) -> EnterCommand:
        self._inside_user(user)
        cgroup = self.cgroup.leaf(leaf) if self.cgroup else None
        assert self.backend.nsenter is not None
        enter = nsenter_argv(
            self.backend.nsenter,
            self.init_pid,
            0,
            self.workdir,
            argv,
            cwd,
            env,
            user_namespace=f"/proc/{self.init_pid}/ns/user",
            preserve_credentials=True,
            net=not self.spec.network,  # (a networked sandbox is on the host's, which it may not join)
        )
        return EnterCommand([*self.rlimit_prefix, *self.backend.seccomp_prefix, *enter], cgroup, "/")


class LocalBackend(Backend):
    name = "local"
    Settings = LocalSettings
    sandbox_class = LocalSandbox

    settings: LocalSettings

    def __init__(self, context) -> None:
        self.hidden_paths = tuple(os.path.realpath(p) for p in context.hidden_paths)
        self.host_paths = tuple(os.path.realpath(p) for p in context.settings.host_paths)
        self.bwrap = shutil.which("bwrap")
        self.nsenter = shutil.which("nsenter")
        self.unshare = shutil.which("unshare")
        self.launcher = ""
        # A daemon that is not root makes its sandboxes without privileges (RootlessSandbox),
        # their writable root an overlay where the kernel allows one (probe), else a copy.
        self.rootless = os.geteuid() != 0 and context.settings.isolation != "none"
        self.root_kind = OVERLAY
        # Rootless: the largest disk cap a capped tmpfs holds (0: none does; the watcher), the
        # watcher as a limit's mechanism, and whether the state disk has reflinks (forks' copies).
        self.tmpfs_max_bytes = 0
        self.disk_watcher = ""
        self.reflinks: bool | None = None
        self.rlimits = SandboxRlimits(held=set(STAND_INS))  # (none until the rootless probe decides)
        self.launch_slots = asyncio.Semaphore(LAUNCH_SLOTS)
        settings = context.settings
        self.images = ImageCache(
            Path(settings.image_cache_dir or context.state_dir / "images"),
            settings.image_cache_bytes,
            settings.engine_socket or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock",
        )
        # The seccomp filter of sandboxes (empty: none) and the prefix that enters under it.
        self.seccomp_program = b""
        self.seccomp_prefix: list[str] = []
        if context.settings.seccomp == "default" and not supported():
            self.seccomp_program = program()
            self.seccomp_prefix = loader_argv(sys.executable, entering=True)
        self._host_secrets: list[str] | None = None
        self.snapshot_store: snapshot_store.SnapshotStore = SnapshotStore(
            "local.snapshot_store_bytes", settings.snapshot_store_bytes
        )
        if self.rootless:
            # Copies under the state directory (forkcopy.py), each counted as the disk it takes.
            self.snapshot_store = snapshot_store.SnapshotStore(
                "local.snapshot_store_bytes",
                settings.snapshot_store_bytes,
                lambda point: usage_bytes(in_own_userns(self.unshare or "unshare"), [str(point)]),
                remove_tree,
            )
        self.pool = node_pool(context.state_dir, settings.storage_bytes) if settings.storage == "btrfs" else None
        super().__init__(context)

    # -- capabilities ------------------------------------------------------------------------------

    def probe(self) -> BackendStatus:
        mode = self.settings.isolation
        cgroups = self.context.cgroups
        limits = {
            "memory": cgroups.support("memory"),
            "pids": cgroups.support("pids"),
            "cpu": cgroups.support("cpu"),
            "wall_clock": LimitSupport(
                True, "process group + cgroup kill" if cgroups.can_track else "process group kill"
            ),
            "network": LimitSupport(True, "network namespace"),
            "disk": self.disk_support,
        }
        missing = []
        if not self.nsenter:
            missing.append(f"{NO_NSENTER} (apt-get install util-linux)")
        if self.rootless:
            return self._probe_rootless(limits, missing)
        if os.geteuid() != 0:
            missing.append(f"{NOT_ROOT}: it needs root to give each sandbox its own uid and cgroup")
        if mode == "none":
            self.pool = None  # (no root of the sandbox's own to fork)
            # Only reachable with local.allow_no_isolation (config validation): commands run as
            # the sandbox's own uid on the host, in its workspace, with cgroup limits but no
            # namespaces. Said loudly everywhere a sandbox describes itself.
            self.launcher, detail = (
                "none",
                'NO ISOLATION (local.isolation = "none"): commands run on the host as an unprivileged uid',
            )
            limits["network"] = LimitSupport(False, reason='local.isolation = "none": no network namespace')
            limits["disk"] = LimitSupport(
                False, reason='local.isolation = "none": commands can write wherever their uid may on the host'
            )
            if os.geteuid() != 0:
                return BackendStatus(False, f"{NOT_ROOT}: it needs root to run commands as another uid", "none", limits)
            return BackendStatus(True, f"{detail}; {self._seccomp_detail()}", "none", limits)
        if mode in ("auto", "bwrap") and self.bwrap:
            self.launcher, detail = "bwrap", _version(self.bwrap) or "bubblewrap"
        elif mode in ("auto", "unshare") and self.unshare and shutil.which("chroot"):
            self.launcher, detail = "unshare", (_version(self.unshare) or "util-linux unshare") + " + chroot"
        else:
            self.launcher, detail = "", ""
            missing.append(f"{NO_BWRAP if mode == 'bwrap' else NO_LAUNCHER} (apt-get install bubblewrap)")
        if not missing and self.pool is not None:
            # (Mounted when the daemon starts, reap_orphans: a probe, as `corral doctor`'s, makes nothing.)
            if lacking := self.pool.lacking():
                missing.append(f'local.storage = "btrfs": {lacking}')
            limits["disk"] = LimitSupport(True, "btrfs subvolume per sandbox, capped by a quota group")
        if not missing:
            lacking = kernel_support()
            if lacking:
                missing.append(f"this kernel cannot give sandboxes a root of their own: {lacking}")
        if missing:
            return BackendStatus(False, "; ".join(missing), "none", limits)
        users = f"root inside a user namespace of {self.context.uids.block} host ids per sandbox"
        return BackendStatus(True, f"{detail}; {users}; {self._seccomp_detail()}", "namespaces", limits)

    def _probe_rootless(self, limits: dict[str, LimitSupport], missing: list[str]) -> BackendStatus:
        """The status of a daemon that is not root: bubblewrap in a user namespace of the daemon's
        user (rootless.py), limits in cgroups where the user was delegated some, else rlimits
        standing in for them (rlimits.py), the disk capped by a tmpfs or watched (diskwatch.py)."""
        self.pool = None  # (the btrfs pool needs root to mount)
        self.rlimits = SandboxRlimits(held={kind for kind, limit in limits.items() if limit.enforced})
        limits = self.rlimits.report(limits)
        if self.settings.isolation == "unshare" or not self.bwrap:
            self.launcher = ""
            missing.append(f"{NO_BWRAP} (apt-get install bubblewrap): a daemon without root needs it")
        else:
            self.launcher = "bwrap"
        if not missing and (lacking := user_namespace_support(self.unshare)):
            missing.append(lacking)
        if missing:
            return BackendStatus(False, "; ".join(missing), "none", limits)
        if not self.context.cgroups.can_track:
            limits["wall_clock"] = LimitSupport(
                True, "process group kill and its descendants' (no cgroup: a process that left the tree is missed)"
            )
        writable = writable_root_kind()
        self.root_kind = writable.root_kind
        self.tmpfs_max_bytes = self.settings.rootless_tmpfs_max_bytes if not writable.why_not_tmpfs else 0
        self.disk_watcher = watcher_mechanism(limits["disk"])
        limits["disk"] = rootless_disk_support(self.tmpfs_max_bytes, writable.why_not_tmpfs, self.disk_watcher)
        root = (
            "writable root: the kernel's unprivileged overlayfs over the image"
            if self.root_kind == OVERLAY
            else f"writable root: a copy of a directory image, the host's system read-only (no unprivileged overlayfs: {writable.why_not_overlay})"
        )
        users = (
            f"ROOTLESS (the daemon is uid {os.getuid()}): root inside a user namespace mapped to the "
            "daemon's own uid and gid, the same for every sandbox; no other inside user"
        )
        detail = f"{_version(self.bwrap or 'bwrap') or 'bubblewrap'}; {users}; {root}; {self._seccomp_detail()}"
        return BackendStatus(True, detail, "namespaces", limits)

    def new_sandbox(self, spec, uid: int) -> ManagedSandbox:
        if self.rootless:
            return RootlessSandbox(self, spec, uid)
        return super().new_sandbox(spec, uid)

    @classmethod
    def own_fixes(cls, status: BackendStatus) -> list[str]:
        found = [FIX_NSENTER] if NO_NSENTER in status.detail else []
        if NO_BWRAP in status.detail or NO_LAUNCHER in status.detail:
            found.append(FIX_BWRAP)
        # Working, on the fallback launcher, where bubblewrap could be installed.
        if status.available and "unshare" in status.detail and shutil.which("bwrap") is None:
            found.append(FIX_BWRAP_OVER_UNSHARE)
        return found

    @property
    def host_secrets(self) -> list[str]:
        """What the host's /etc keeps from other users, covered in "host" sandboxes (root.py):
        looked for once, when the first sandbox starts."""
        if self._host_secrets is None:
            self._host_secrets = secrets()
        return self._host_secrets

    def _seccomp_detail(self) -> str:
        """The seccomp filter as the backend's status reports it (doctor, GetNodeInfo)."""
        if self.seccomp_program:
            return "seccomp filter: default"
        if self.settings.seccomp == "none":
            return 'NO SECCOMP FILTER (local.seccomp = "none")'
        return f"NO SECCOMP FILTER ({supported()})"

    def default_image(self) -> str:
        return "host"

    async def cached_images(self) -> list[str]:
        return self.images.cached()

    # -- create ------------------------------------------------------------------------------------

    def rootfs(self, image: str) -> str:
        """The root filesystem directory of an image ("host": "/", of which root_layout shows the OS only)."""
        if image in ("", "host"):
            return "/"
        if (source := parse_reference(image)) is not None:
            return self.images.rootfs(source)  # as check_image prepared it
        if not os.path.isabs(image):
            raise InvalidArgument(
                'local image must be "host", an absolute path to a root filesystem or a container image '
                f"(docker-archive:PATH, oci-archive:PATH, oci:PATH, docker:NAME), got {image!r}"
            )
        if not os.path.isdir(image):
            raise InvalidArgument(f"local image {image} is not a directory")
        return os.path.realpath(image)

    def fork_points(self) -> Path:
        """Where a daemon without root keeps fork points until their children exist."""
        return self.context.state_dir / "forks" / self.name

    def snapshots(self) -> Path:
        """Where a daemon without root keeps named snapshots (until deleted or its next start)."""
        return self.context.state_dir / "snapshots" / self.name

    async def _copy_point(self, sandbox: SandboxRuntime, point: Path) -> ForkPoint:
        """A rootless sandbox's fork point: a copy at `point` (forkcopy.py)."""
        assert isinstance(sandbox, RootlessSandbox)
        point.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        if self.reflinks is None:  # (tried at the first fork: a probe makes nothing)
            self.reflinks = await asyncio.to_thread(has_reflinks, point.parent)
        return await asyncio.to_thread(sandbox.fork_point, point)

    def _forkable(self, sandbox: SandboxRuntime) -> tuple[StoragePool, LocalSandbox]:
        if self.pool is None or not isinstance(sandbox, LocalSandbox) or sandbox.subvolume is None:
            raise CannotFork(
                'forking local sandboxes needs copy-on-write storage: set local.storage = "btrfs" '
                '(docs/local-backend.md, "Fork")'
            )
        return self.pool, sandbox

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        if self.rootless:
            assert isinstance(sandbox, RootlessSandbox)
            return await self._copy_point(
                sandbox, self.fork_points() / f"{sandbox.spec.sandbox_id}-{tokens.token_hex(4)}"
            )
        pool, local = self._forkable(sandbox)
        point = pool.forks / f"{local.spec.sandbox_id}-{tokens.token_hex(4)}"
        return await asyncio.to_thread(local.fork_point, point)

    async def keep_snapshot(self, sandbox: SandboxRuntime, name: str) -> tuple[ForkPoint, int]:
        if self.rootless:
            point = await self._copy_point(sandbox, self.snapshots() / name)
        else:
            pool, local = self._forkable(sandbox)
            point = await asyncio.to_thread(local.fork_point, pool.snapshots / name)
        return point, await asyncio.to_thread(self.snapshot_store.admit, Path(point.path), point.source_id)

    async def drop_fork_point(self, point: ForkPoint) -> None:
        path = Path(point.path)
        if not self.rootless or path.parent in (self.fork_points(), self.snapshots()):
            await asyncio.to_thread(self.snapshot_store.drop, path)

    async def check_image(self, image: str) -> None:
        source = parse_reference(image)
        rootfs = await self.images.prepare(source) if source else self.rootfs(image)
        if not os.path.exists(os.path.join(rootfs, "bin/sh")) and not os.path.islink(os.path.join(rootfs, "bin")):
            raise InvalidArgument(f"image {image} has no /bin/sh")

    # -- leftovers ---------------------------------------------------------------------------------

    async def release(self, record: dict) -> None:
        pid = record.get("launcher_pid")
        if pid and is_process(pid, ("bwrap", "unshare")):
            _kill(pid)
        sandbox_dir = Path(record.get("sandbox_dir", ""))
        if sandbox_dir.parent == self.context.sandboxes_dir:
            await asyncio.to_thread(unmount_root, sandbox_dir)

    async def reap_orphans(self) -> None:
        if self.rootless:
            # A killed daemon's fork points and named snapshots (no snapshot outlives its daemon).
            for kept in (self.fork_points(), self.snapshots()):
                await asyncio.to_thread(remove_tree, kept)
        for group in self.context.cgroups.existing_groups():
            await asyncio.to_thread(group.kill)
            await asyncio.to_thread(group.remove)
        for base in (self.context.sandboxes_dir, self.context.run_base):
            if base.is_dir():
                for leftover in base.iterdir():
                    await asyncio.to_thread(unmount_root, leftover)
                    await asyncio.to_thread(diskcap.unmount, leftover)
                    await asyncio.to_thread(shutil.rmtree, leftover, True)
                    if self.rootless:
                        await asyncio.to_thread(remove_tree, leftover)
        if self.pool is not None and self.status().available:
            try:
                await asyncio.to_thread(self.pool.open)
                await asyncio.to_thread(self.pool.reap)
            except OSError as err:
                log.error("the local backend cannot make sandboxes: %s", err)
                status = self.status()
                self._status = replace(
                    status, available=False, detail=f'local.storage = "btrfs": {err.strerror or err}'
                )
        await self.images.start()

    async def close(self) -> None:
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)
        try:
            self.context.run_base.rmdir()
        except OSError:
            pass


def as_sandbox_user(uid: int) -> list[str]:
    """The host command prefix that runs what follows as the sandbox's uid (its own group, no
    supplementary groups)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def _memfd(name: str, data: bytes) -> int:
    """A memory file holding `data`, read from its start by the process it is passed to."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
