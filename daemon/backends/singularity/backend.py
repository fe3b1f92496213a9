"""The Singularity/Apptainer backend: a sandbox runs a SIF file or sandbox directory under
`apptainer exec`, in a user namespace of its own, entered from the host like a local sandbox.

The daemon makes the sandbox's user namespace itself, as for the local backend: ids 0 .. 65535
inside are the sandbox's block of host ids (daemon/uids.py), so root inside is an unprivileged host
uid of its own. It builds the sandbox's root as the local backend does (root.py): the image
(a directory, or the root partition of a SIF file, loop-mounted read-only: sif_mount.py) shown
through the block's ids by an idmapped mount, under a writable overlay layer in the sandbox's
disk-capped directory. Apptainer then runs inside that user namespace as its root, unprivileged
(no setuid starter, no FUSE): `exec --containall --no-home --no-privs --writable --net --network
none` makes the mount, pid, ipc and net namespaces (owned by the sandbox's user namespace), binds
the workspace, the run directory and plain staging mounts of CreateSandbox's host paths
(idmapped_binds.py), and starts the sandbox's init, a shell that reads its stdin, which the daemon
holds: when the daemon goes, so does the sandbox. All of it runs inside the sandbox's cgroup. The
daemon makes the kernel's settings under /proc and /sys read-only in it, as Docker does, and
enters its namespaces, its user namespace last (container_enter.py), as root inside, or the user a
request names, for commands, shells and kernels, with Docker's default capabilities for root
(within the sandbox's user namespace only), no_new_privs and a seccomp filter. Files go through
/proc/<init>/root as the user's host ids, as for the other backends.
ForkSandbox and named snapshots copy the root's writable layer and the workspace (fork_point;
snapshots are kept under the state directory, bounded by snapshot_store_bytes, until deleted or
the daemon's next start), and each new sandbox moves the copy's owners to its own block.
Works with either binary name, `apptainer` or `singularity`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import secrets as tokens
import shutil
import signal
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound

from ...cgroups import CgroupGroup, LimitSupport
from ...diskcap import DiskCapError, disk_usage, run_step
from ...fsaccess import SandboxFiles
from ...process import in_cgroup, is_process
from ...users import INSIDE_ID_COUNT, SandboxUser
from ..base import RUN_DIR_IN_SANDBOX, Backend, BackendStatus, EnterCommand, ForkPoint, SandboxRuntime
from ..container_enter import (
    CAPABILITY_MASK,
    HOST_NETWORK_CAPABILITY_MASK,
    ImageUserSandbox,
    read_only_argv,
    resolve_in_image,
)
from ..idmapped_binds import check_shown
from ..mount_api import detach, make_user_namespace
from ..nsenter import HOST_ENV
from ..root import (
    INIT_READY,
    RootMount,
    build_root,
    kernel_support,
    make_mount_points,
    refusing_unbuildable,
    unmount_root,
)
from ..snapshot_store import SnapshotStore
from ..unprivileged import only_root, remove_tree, user_namespace_support
from .rootless import ImageCopies, enter_argv, fakeroot_detail, rootless_argv, subordinate_ids
from .sif_mount import mount_sif

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
# What the probe says is missing, and what `corral doctor` says to do about it (own_fixes).
NO_APPTAINER = "neither apptainer nor singularity is installed"
FIX_APPTAINER = (
    "install Apptainer: scripts/install_apptainer.sh in corral's repository (as root, Debian 12 or 13 on amd64), "
    "elsewhere https://apptainer.org/docs/admin/main/installation.html"
)
# Where, under the daemon's run directories (searchable by all: run_dir_base), the launcher shows
# apptainer what it needs, in a mount namespace of its own (see _LAUNCH_SCRIPT): apptainer runs as
# the sandbox's block, which may not search the directories above the daemon's state (a private
# temporary directory, say).
VIEW_NAME = ".apptainer"
# The launcher, host root in a private mount namespace: a tmpfs over the view, holding the sandbox's
# directory (its root, workspace and apptainer's configuration), its run directory and each host
# path of CreateSandbox's mounts (a plain bind, not recursive, nosuid and nodev, read-only unless
# asked: the kernel shows its files through the sandbox's ids, root's as nobody's), then nsenter,
# which joins the sandbox's user namespace as its root and execs apptainer. Nothing of it reaches
# the host's mount namespace: it goes with the launcher.
# argv: view, sandbox directory, run directory, count of mounts, "ro|rw <host path>" each, command.
_LAUNCH_SCRIPT = r"""
set -e
view=$1 sandbox=$2 run=$3 count=$4
shift 4
mount -t tmpfs -o mode=0755,size=1m,nosuid,nodev corral-launch "$view"
mkdir -p "$view/sandbox" "$view/run" "$view/binds"
mount --rbind "$sandbox" "$view/sandbox"
mount --bind "$run" "$view/run"
n=0
while [ "$n" -lt "$count" ]; do
    mode=${1%% *} host=${1#* }
    shift
    if [ -d "$host" ]; then mkdir "$view/binds/$n"; else : > "$view/binds/$n"; fi
    mount --bind -o "$mode,nosuid,nodev" "$host" "$view/binds/$n"
    n=$((n + 1))
done
exec "$@"
"""
# The sandbox's init, the image's shell as pid 1 of its pid namespace (apptainer's --no-init: a
# shim of apptainer's would end the sandbox when this shell ends, and kill(-1) from inside, which
# spares pid 1 alone, would end it): it reaps orphans as they exit (zombies count against the pids
# limit) and exits once its stdin, the daemon's, closes. A signal the trap ran for ends `read`
# with the same status as the end of input: `interrupted` tells them apart. Apptainer's private
# /tmp and /var/tmp (tmpfs) are its user's, 0755, in this mode: they become everyone's, as usual.
INIT_SCRIPT = """trap 'interrupted=1; wait' CHLD
chmod 1777 /tmp /var/tmp
printf 'corral-init-ready\\n'
while :; do interrupted=; read -r _ && continue; [ -n "$interrupted" ] || exit 0; done
"""
# What a fork point holds (SingularitySandbox.fork_point).
UPPER, WORKSPACE = "upper", "workspace"
# What a sandbox's launcher (nsenter, exec'ing apptainer and its starter) is called.
LAUNCHER_NAMES = ("nsenter", "apptainer", "singularity", "starter")
# Where a daemon without root explains what its sandboxes can and cannot do.
ROOTLESS_DOCS = 'docs/backends.md, "Apptainer / Singularity", "Without root"'
# Characters apptainer's --bind syntax (src:dst:opts, comma-separated) cannot carry in a path.
BIND_SEPARATORS = (":", ",")


async def _run(argv: list[str], timeout: float, cgroup: CgroupGroup | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *in_cgroup(argv, cgroup),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(HOST_ENV),
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"timed out after {timeout:g}s"
    assert proc.returncode is not None  # communicate() returned: the process has exited
    return proc.returncode, out.decode(errors="replace").strip()


@dataclass
class SingularitySettings:
    """The [singularity] configuration section."""

    default_image: str = ""  # absolute path of the SIF file or sandbox directory for requests naming none
    # What named snapshots (SnapshotSandbox) of singularity sandboxes may hold together, each
    # counted as the disk its copy takes.
    snapshot_store_bytes: int = 64 << 30

    def validate(self) -> None:
        if self.default_image and not os.path.isabs(self.default_image):
            raise ValueError("default_image must be an absolute path")
        if self.snapshot_store_bytes < 0:
            raise ValueError("snapshot_store_bytes must be 0 (no named snapshots) or positive")


class SingularitySandbox(ImageUserSandbox):
    isolation = "container"
    # The root's writable layer and the workspace are in the sandbox directory, and --containall
    # gives /tmp and /var/tmp in-memory tmpfs mounts (charged to the sandbox's memory cgroup): all
    # it can write to the host's disk is on the sandbox's own filesystem.
    caps_disk = True
    join_user_namespace = True

    @property
    def capabilities(self) -> int:
        # Without --net the sandbox shares the host's network namespace.
        return HOST_NETWORK_CAPABILITY_MASK if self.spec.network else CAPABILITY_MASK

    backend: SingularityBackend

    def __init__(self, backend: SingularityBackend, spec, uid: int) -> None:
        super().__init__(backend, spec, uid)
        self._userns_fd = -1
        self._launcher: subprocess.Popen | None = None

    def host_ids(self, user: SandboxUser) -> tuple[int, int]:
        return self.uid + user.uid, self.uid + user.gid  # the sandbox's block (daemon/uids.py)

    def host_id_block(self) -> tuple[int, int]:
        return self.uid, INSIDE_ID_COUNT

    async def launch(self) -> None:
        binary = self.backend.binary
        assert binary is not None
        for mount in self.spec.mounts:
            if any(c in mount.sandbox_path for c in BIND_SEPARATORS):
                raise InvalidArgument(f"mount {mount.sandbox_path}: apptainer cannot bind a path with ':' or ','")
        self._userns_fd = await asyncio.to_thread(make_user_namespace, self.uid)
        root = await asyncio.to_thread(self._build_root)
        config_dir = self.sandbox_dir / "apptainer"  # apptainer's own files (~/.apptainer), the block's
        config_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(config_dir, self.uid, self.uid)
        view = self.context.run_base / VIEW_NAME
        view.mkdir(mode=0o755, exist_ok=True)
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            _LAUNCH_SCRIPT,
            "corral-launch",
            str(view),
            str(self.sandbox_dir),
            str(self.run_dir),
            str(len(self.spec.mounts)),
            *(f"{'ro' if m.read_only else 'rw'} {m.host_path}" for m in self.spec.mounts),
            "nsenter",
            f"--user=/proc/self/fd/{self._userns_fd}",
            "--setuid=0",
            "--setgid=0",
            "--",
            binary,
            "exec",
            "--containall",
            "--no-home",
            "--no-privs",
            "--no-init",
            "--writable",
            "--hostname",
            "corral",
            "--bind",
            f"{view / 'sandbox' / self.workspace.name}:{self.workdir}",
            "--bind",
            f"{view / 'run'}:{RUN_DIR_IN_SANDBOX}",
            # The site's `bind path` entries (by default the host's /etc/localtime): the sandbox
            # gets only the binds corral makes.
            "--no-mount",
            "bind-paths",
        ]
        for n, mount in enumerate(self.spec.mounts):
            argv += ["--bind", f"{view / 'binds' / str(n)}:{mount.sandbox_path}:{'ro' if mount.read_only else 'rw'}"]
        if not self.spec.network:
            argv += ["--net", "--network", "none"]
        argv += [str(view / "sandbox" / root.name), "/bin/sh", "-c", INIT_SCRIPT]
        config = str(view / "sandbox" / config_dir.name)
        env = {**HOST_ENV, "APPTAINER_CONFIGDIR": config, "HOME": config}
        # Spawned from the event loop thread on purpose: nothing here may die with a worker.
        self._launcher = subprocess.Popen(
            in_cgroup(argv, self.cgroup.leaf("init") if self.cgroup else None),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd="/",
            start_new_session=True,
            pass_fds=(self._userns_fd,),
        )
        await self._await_init(binary)
        code, out = await _run(read_only_argv(self.init_pid), START_TIMEOUT_S)
        if code != 0:
            raise FailedPrecondition(f"cannot make the kernel's settings read-only in the sandbox: {out}")
        await asyncio.to_thread(check_shown, self.spec.mounts, self.uid, self.init_pid, False)
        self.adopt_user("")

    async def _await_init(self, binary: str) -> None:
        """Waits for the launcher's init to say it is ready, and finds its host pid."""
        assert self._launcher is not None and self._launcher.stdout is not None
        try:
            ready = await asyncio.wait_for(asyncio.to_thread(self._launcher.stdout.readline), START_TIMEOUT_S)
        except TimeoutError:
            ready = b""
        if ready != INIT_READY:
            _kill(self._launcher.pid)
            said = (ready + await asyncio.to_thread(self._launcher.stdout.read)).decode(errors="replace").strip()
            raise FailedPrecondition(f"{os.path.basename(binary)} could not start the sandbox: {said or 'no output'}")
        self.init_pid = _container_init(self._launcher.pid)

    def fork_point(self, point: Path) -> ForkPoint:
        """Pauses the sandbox (where its cgroup can be frozen: cgroup v2), copies its root's
        writable layer and its workspace to `point` (reflinks where the filesystem has them), and
        resumes it. Nothing is left at `point` when the copy fails."""
        point.mkdir(mode=0o700)
        try:
            frozen = bool(self.cgroup) and self.cgroup.freeze(True)  # type: ignore[union-attr]
            try:
                for name, src in ((UPPER, self.sandbox_dir / "layers" / "upper"), (WORKSPACE, self.workspace)):
                    run_step(["cp", "-a", "--reflink=auto", str(src), str(point / name)], "copy", f"sandbox {name}")
            finally:
                if frozen:
                    self.cgroup.freeze(False)  # type: ignore[union-attr]
        except BaseException:
            shutil.rmtree(point, ignore_errors=True)
            raise
        return ForkPoint(self.spec.sandbox_id, str(point), self.uid)

    def _take_fork(self, fork: ForkPoint) -> None:
        """A fork's child starts from the fork point's copy of its parent's writable layer and
        workspace, their files moved from the parent's block of host ids to its own."""
        point, layers = Path(fork.path), self.sandbox_dir / "layers"
        layers.mkdir(mode=0o700, exist_ok=True)
        run_step(["cp", "-a", "--reflink=auto", str(point / UPPER), str(layers / "upper")], "copy", "the fork point")
        run_step(
            ["cp", "-a", "--reflink=auto", f"{point / WORKSPACE}/.", str(self.workspace)], "copy", "the fork point"
        )
        for top in (layers / "upper", self.workspace):
            shift_ids(top, fork.disk_base, self.uid)

    def _build_root(self) -> Path:
        """The sandbox's root: the image (a directory, or a SIF file's root partition mounted at
        image/) shown through the block's ids, under a writable layer of the sandbox's own
        (root.py, as on the local backend), with the mount points apptainer binds on."""
        if self.spec.fork is not None:
            # (An OS error, as a node's: a copy past the child's disk cap is RESOURCE_EXHAUSTED,
            # one cut short UNAVAILABLE; never the FAILED_PRECONDITION of a backend that cannot fork.)
            self._take_fork(self.spec.fork)
        image = self.spec.image
        if not os.path.isdir(image):
            target = self.sandbox_dir / "image"
            target.mkdir(mode=0o700)
            try:
                mount_sif(image, target)
            except DiskCapError as err:
                raise FailedPrecondition(err.strerror or str(err)) from err
            image = str(target)
        with refusing_unbuildable(self.spec.image):
            root = build_root(
                [RootMount("overlay", image, "/")],
                self.sandbox_dir,
                self.uid,
                self._userns_fd,
                (self.workdir, RUN_DIR_IN_SANDBOX),
            )
        make_mount_points(root, [(m.sandbox_path, os.path.isdir(m.host_path)) for m in self.spec.mounts], self.uid)
        return root

    async def shutdown(self) -> None:
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            for pipe in (launcher.stdin, launcher.stdout):
                if pipe is not None:
                    pipe.close()  # the init's stdin: it exits, and apptainer with it
            _kill(launcher.pid)
            await asyncio.to_thread(launcher.wait)
        await asyncio.to_thread(unmount_sandbox, self.sandbox_dir)
        if self._userns_fd >= 0:
            os.close(self._userns_fd)
            self._userns_fd = -1

    def alive(self) -> bool:
        return self._launcher is not None and self._launcher.poll() is None

    def record_extra(self) -> dict:
        return {"launcher_pid": self._launcher.pid if self._launcher else 0}


class RootlessSingularitySandbox(SingularitySandbox):
    """A sandbox of a daemon that is not root (rootless.py): Apptainer's own unprivileged mode as
    the daemon's user, root inside being that user, over a copy of the image the user owns. Its
    writable layer (layers/upper, --overlay) and workspace are where the root mode keeps them, so
    that forks and snapshots copy them the same way (one uid: no owner to move)."""

    # No filesystem of its own without root (diskcap mounts one): its disk is the state directory's.
    caps_disk = False

    def host_ids(self, user: SandboxUser) -> tuple[int, int]:
        return os.getuid(), os.getgid()

    def host_id_block(self) -> tuple[int, int]:
        return os.getuid(), 1

    def user_host_ids(self, user: str) -> tuple[int, int] | None:
        self._root_only(user)
        return os.getuid(), os.getgid()

    def _root_only(self, user: str) -> SandboxUser:
        """`user` ("" = the default) as the image knows it, refused unless it is root."""
        if not user:
            return self.user
        return only_root(resolve_in_image(self.init_pid, user), user, ROOTLESS_DOCS)

    def adopt_user(self, image_user: str) -> None:
        spec = self.spec.user or image_user or "root"
        self.user = only_root(resolve_in_image(self.init_pid, spec), spec, ROOTLESS_DOCS)

    async def _make_dirs(self) -> None:
        # (Owned by the daemon's uid, which is root inside: nothing to give away.)
        self.sandbox_dir.mkdir(parents=True, exist_ok=True)
        self.sandbox_dir.parent.chmod(0o711)
        for sub in ("workspace", "apptainer"):
            (self.sandbox_dir / sub).mkdir(mode=0o700, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o711)

    async def launch(self) -> None:
        binary = self.backend.binary
        assert binary is not None
        for mount in self.spec.mounts:
            if any(c in f"{mount.host_path}{mount.sandbox_path}" for c in BIND_SEPARATORS):
                raise InvalidArgument(f"mount {mount.sandbox_path}: apptainer cannot bind a path with ':' or ','")
        image = await self.backend.image_copies.get(self.spec.image)
        if self.spec.fork is not None:
            await asyncio.to_thread(self._take_fork, self.spec.fork)
        argv = rootless_argv(
            binary,
            image,
            overlay=self.sandbox_dir / "layers",
            workspace=self.workspace,
            workdir=self.workdir,
            run_dir=self.run_dir,
            mounts=self.spec.mounts,
            network=self.spec.network,
            init_script=INIT_SCRIPT,
        )
        (self.sandbox_dir / "layers").mkdir(mode=0o700, exist_ok=True)
        config = str(self.sandbox_dir / "apptainer")
        # Spawned from the event loop thread on purpose: nothing here may die with a worker.
        self._launcher = subprocess.Popen(
            in_cgroup(argv, self.cgroup.leaf("init") if self.cgroup else None),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**HOST_ENV, "APPTAINER_CONFIGDIR": config, "HOME": config},
            cwd="/",
            start_new_session=True,
        )
        await self._await_init(binary)
        self.adopt_user("")

    def enter_command(
        self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str], user: str = ""
    ) -> EnterCommand:
        self._root_only(user)
        cgroup = self.cgroup.leaf(leaf) if self.cgroup else None
        return EnterCommand(
            enter_argv(self.init_pid, self.workdir, argv, cwd, env, network=self.spec.network), cgroup, "/"
        )

    def make_file_access(self) -> SandboxFiles:
        """File access through the init's root as the daemon itself (its uid is root inside)."""
        return SandboxFiles(f"/proc/{self.init_pid}/root", self.workdir, None, None, self.context.max_file_bytes)

    async def destroy(self) -> None:
        await super().destroy()
        # What the daemon's user may not remove without first giving itself the permission
        # (overlayfs's mode 000 work directory).
        await asyncio.to_thread(remove_tree, self.sandbox_dir)


def shift_ids(top: Path, from_first: int, to_first: int) -> None:
    """Gives every entry under `top` (itself included, symlinks not followed) whose owner or group
    is in the block of host ids from `from_first` the same id in the block from `to_first`
    (setuid and setgid bits, which a chown clears, kept)."""
    _shift(str(top), from_first, to_first)
    for parent, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            _shift(os.path.join(parent, name), from_first, to_first)


def _shift(path: str, from_first: int, to_first: int) -> None:
    st = os.lstat(path)
    uid, gid = (
        i - from_first + to_first if from_first <= i < from_first + INSIDE_ID_COUNT else i
        for i in (st.st_uid, st.st_gid)
    )
    if (uid, gid) != (st.st_uid, st.st_gid):
        os.lchown(path, uid, gid)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(path, stat.S_IMODE(st.st_mode))


def _container_init(launcher_pid: int) -> int:
    """The host pid of the sandbox's init script: the one process under the launcher that has no
    child yet, in a pid namespace below the host's (apptainer's own processes wait for theirs)."""
    todo, found = [launcher_pid], []
    while todo:
        pid = todo.pop()
        children = [
            int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()
        ]
        todo += children
        if not children and _nested_pid(pid):
            found.append(pid)
    if len(found) != 1:
        raise FailedPrecondition(f"cannot tell the sandbox's init among the launcher's processes ({found})")
    return found[0]


def _nested_pid(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) > 2
    return False


async def _copy_point(sandbox: SingularitySandbox, point: Path) -> ForkPoint:
    point.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    return await asyncio.to_thread(sandbox.fork_point, point)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _kill(pid: int) -> None:
    """SIGKILL to the launcher's process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def unmount_sandbox(sandbox_dir: Path) -> None:
    """Detaches a sandbox's root and its image's mount (nothing where there is none)."""
    unmount_root(sandbox_dir)
    image = sandbox_dir / "image"
    if os.path.ismount(image):
        detach(image)


class SingularityBackend(Backend):
    name = "singularity"
    Settings = SingularitySettings
    sandbox_class = SingularitySandbox

    settings: SingularitySettings

    def __init__(self, context) -> None:
        self.binary = shutil.which("apptainer") or shutil.which("singularity")
        # A daemon that is not root runs Apptainer's own unprivileged mode (RootlessSingularitySandbox)
        # over copies of its images that the daemon's user owns.
        self.rootless = os.geteuid() != 0
        self.image_copies = ImageCopies(context.state_dir / "singularity-images")
        self.snapshot_store = SnapshotStore(
            "singularity.snapshot_store_bytes", context.settings.snapshot_store_bytes, disk_usage, _remove_tree
        )
        super().__init__(context)

    def probe(self) -> BackendStatus:
        cgroups = self.context.cgroups
        limits = {
            "memory": cgroups.support("memory"),
            "pids": cgroups.support("pids"),
            "cpu": cgroups.support("cpu"),
            "wall_clock": LimitSupport(True, "process group + cgroup kill"),
            "network": LimitSupport(True, "network namespace of its own (--net --network none)"),
            "disk": LimitSupport(
                self.disk_support.enforced,
                f"workspace: {self.disk_support.mechanism}; /tmp and /var/tmp: apptainer's in-memory "
                "tmpfs, counted against the memory limit instead",
                self.disk_support.reason,
            ),
        }
        problems = []
        if not self.binary:
            problems.append(NO_APPTAINER)
        problems += [
            f"{tool} (util-linux) is not installed" for tool in ("unshare", "nsenter") if not shutil.which(tool)
        ]
        if self.rootless:
            if why_not := user_namespace_support(shutil.which("unshare")):
                problems.append(why_not)
            limits = self._rootless_limits(limits)
        elif why_not := kernel_support():
            problems.append(why_not)
        version = ""
        if self.binary:
            try:
                version = subprocess.run(
                    [self.binary, "version"], capture_output=True, text=True, timeout=10
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError) as err:
                problems.append(f"{self.binary} does not run: {err}")
        if problems or not self.binary:
            return BackendStatus(False, "; ".join(problems), "none", limits)
        detail = f"{os.path.basename(self.binary)} {version}"
        if self.rootless:
            detail += "; " + self._rootless_detail()
        return BackendStatus(True, detail, "container", limits)

    def _rootless_limits(self, limits: dict[str, LimitSupport]) -> dict[str, LimitSupport]:
        """What a daemon without root enforces: cgroup limits only where the user was delegated
        some (the cgroup driver's reasons otherwise), no disk cap (no filesystem of the sandbox's
        own without root)."""
        cgroups = self.context.cgroups
        return {
            **limits,
            "wall_clock": LimitSupport(
                True,
                "process group + cgroup kill"
                if cgroups.can_track
                else "process group kill and its descendants' (no cgroup: a process that left the tree is missed)",
            ),
            "network": LimitSupport(True, "network namespace of its own (--net --network none, unprivileged)"),
            "disk": LimitSupport(
                False,
                reason="the daemon is not root: it cannot mount a size-capped filesystem per sandbox; the writable "
                "layer and workspace lie on the state directory's disk, /tmp on apptainer's in-memory tmpfs",
            ),
        }

    def _rootless_detail(self) -> str:
        why_no_range = subordinate_ids(pwd.getpwuid(os.getuid()))
        return (
            f"ROOTLESS (the daemon is uid {os.getuid()}): apptainer's unprivileged mode; "
            f"{fakeroot_detail(why_no_range)}; requests run as root only; image: a copy the daemon's user owns "
            "(a SIF unpacked once per image); writable layer: --overlay on the sandbox's own directory"
        )

    @classmethod
    def own_fixes(cls, status: BackendStatus) -> list[str]:
        return [FIX_APPTAINER] if NO_APPTAINER in status.detail else []

    def new_sandbox(self, spec, uid: int) -> SingularitySandbox:
        if self.rootless:
            return RootlessSingularitySandbox(self, spec, uid)
        return SingularitySandbox(self, spec, uid)

    def default_image(self) -> str:
        return self.settings.default_image

    async def check_image(self, image: str) -> None:
        if not image or image == "host" or not os.path.isabs(image):
            raise InvalidArgument("the singularity backend needs the absolute path of a SIF file or sandbox directory")
        if not os.path.exists(image):
            raise NotFound(f"image {image} does not exist on this node")

    def fork_points(self) -> Path:
        """Where fork points wait for their children (removed once they exist)."""
        return self.context.state_dir / "forks" / self.name

    def snapshots(self) -> Path:
        """Where named snapshots are kept (fork points under a name, until DeleteSnapshot or the
        daemon's next start)."""
        return self.context.state_dir / "snapshots" / self.name

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        assert isinstance(sandbox, SingularitySandbox)
        return await _copy_point(sandbox, self.fork_points() / f"{sandbox.spec.sandbox_id}-{tokens.token_hex(4)}")

    async def keep_snapshot(self, sandbox: SandboxRuntime, name: str) -> tuple[ForkPoint, int]:
        """The fork's copy, kept under `name` and counted against singularity.snapshot_store_bytes
        (RESOURCE_EXHAUSTED and nothing kept past it)."""
        assert isinstance(sandbox, SingularitySandbox)
        point = await _copy_point(sandbox, self.snapshots() / name)
        return point, await asyncio.to_thread(self.snapshot_store.admit, Path(point.path), sandbox.spec.sandbox_id)

    async def drop_fork_point(self, point: ForkPoint) -> None:
        path = Path(point.path)
        if path.parent in (self.fork_points(), self.snapshots()):
            await asyncio.to_thread(self.snapshot_store.drop, path)

    async def release(self, record: dict) -> None:
        # (A killed daemon's sandboxes end by themselves: their init's stdin was the daemon's.)
        pid = record.get("launcher_pid")
        if isinstance(pid, int) and pid > 0 and is_process(pid, LAUNCHER_NAMES):
            _kill(pid)
        sandbox_dir = Path(record.get("sandbox_dir", ""))
        if sandbox_dir.parent == self.context.sandboxes_dir:
            await asyncio.to_thread(unmount_sandbox, sandbox_dir)
            if self.rootless:
                await asyncio.to_thread(remove_tree, sandbox_dir)  # (overlayfs's mode 000 work directory)

    async def reap_orphans(self) -> None:
        # A killed daemon's fork points and named snapshots (no snapshot outlives its daemon).
        for kept in (self.fork_points(), self.snapshots()):
            await asyncio.to_thread(_remove_tree, kept)
        if self.context.sandboxes_dir.is_dir():
            for leftover in self.context.sandboxes_dir.iterdir():
                await asyncio.to_thread(unmount_sandbox, leftover)

    async def close(self) -> None:
        for directory in (self.context.run_base / VIEW_NAME, self.context.run_base):
            try:
                directory.rmdir()
            except OSError:
                pass  # none made, or still in use (the other backends' run directories)
