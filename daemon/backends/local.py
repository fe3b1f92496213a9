"""The local backend: a sandbox is a set of Linux namespaces on the host, made by bubblewrap (or,
where it is missing, util-linux unshare + chroot; see local_launch.py).

Per sandbox the daemon keeps a directory with `workspace/` (mounted read-write at the workdir) and
`tmp/` (mounted at /tmp). The root is a read-only tmpfs holding read-only binds of the image's
top-level entries ("host": the host's own /), with /proc, /dev and /run private. The daemon's
state directory and socket directory are hidden behind empty tmpfs mounts.

A long-lived init process (`sh -c 'read'`, its stdin held by the daemon) keeps the namespaces
alive; commands enter them with nsenter as the sandbox's own unprivileged uid, in a leaf cgroup of
the sandbox's cgroup. If the daemon dies, init's stdin closes and the sandbox winds itself down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..cgroups import CgroupDriver, CgroupGroup, LimitSupport
from ..config import Config
from corral.sdk.errors import FailedPrecondition, InvalidArgument
from ..fsaccess import SandboxFiles
from ..uids import UidPool
from ..process import in_cgroup
from .base import (
    RUN_DIR_IN_SANDBOX, Backend, BackendStatus, EnterCommand, SandboxRuntime, SandboxSpec, remove_sandbox_dirs,
    run_dir_base,
)
from .nsenter import inside_env, nsenter_argv
from .local_launch import INIT_READY, bwrap_argv, init_pid, root_layout, unshare_argv

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


def _version(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class LocalBackend(Backend):
    name = "local"

    def __init__(
        self, config: Config, cgroups: CgroupDriver, hidden_paths: Sequence[str],
        run_base: Path | None = None, uids: UidPool | None = None,
    ) -> None:
        self.config = config
        self.run_base = run_base or run_dir_base(cgroups.daemon_id)
        self.cgroups = cgroups
        self.hidden_paths = [os.path.realpath(p) for p in hidden_paths]
        self.sandboxes_dir = config.state_path / "sandboxes"
        self.uids = uids or UidPool(config.local.uid_base, config.local.uid_count)
        self.bwrap = shutil.which("bwrap")
        self.nsenter = shutil.which("nsenter")
        self.unshare = shutil.which("unshare")
        self.launcher = ""
        self._status = self._probe()

    # -- capabilities ------------------------------------------------------------------------------

    def _probe(self) -> BackendStatus:
        mode = self.config.local.isolation
        limits = {
            "memory": self.cgroups.support("memory"),
            "pids": self.cgroups.support("pids"),
            "cpu": self.cgroups.support("cpu"),
            "wall_clock": LimitSupport(True, "process group + cgroup kill" if self.cgroups.can_track else "process group kill"),
            "network": LimitSupport(True, "network namespace"),
        }
        missing = []
        if not self.nsenter:
            missing.append("nsenter is not installed (apt-get install util-linux)")
        if os.geteuid() != 0:
            missing.append("the daemon is not root: it needs root to give each sandbox its own uid and cgroup")
        if mode == "none":
            # Only reachable with local.allow_no_isolation (config validation): commands run as
            # the sandbox's own uid on the host, in its workspace, with cgroup limits but no
            # namespaces. Said loudly everywhere a sandbox describes itself.
            self.launcher, detail = "none", "NO ISOLATION (local.isolation = \"none\"): commands run on the host as an unprivileged uid"
            limits["network"] = LimitSupport(False, reason='local.isolation = "none": no network namespace')
            if os.geteuid() != 0:
                return BackendStatus(False, "the daemon is not root: it needs root to run commands as another uid", "none", limits)
            return BackendStatus(True, detail, "none", limits)
        if mode in ("auto", "bwrap") and self.bwrap:
            self.launcher, detail = "bwrap", _version(self.bwrap) or "bubblewrap"
        elif mode in ("auto", "unshare") and self.unshare and shutil.which("chroot"):
            self.launcher, detail = "unshare", (_version(self.unshare) or "util-linux unshare") + " + chroot"
        else:
            self.launcher, detail = "", ""
            missing.append(
                "bubblewrap is not installed (apt-get install bubblewrap)" if mode == "bwrap"
                else f'local.isolation = "{mode}" cannot run sandboxes' if mode == "none"
                else "neither bubblewrap nor util-linux unshare and chroot are installed (apt-get install bubblewrap)"
            )
        if missing:
            return BackendStatus(False, "; ".join(missing), "none", limits)
        return BackendStatus(True, detail, "namespaces", limits)

    def status(self) -> BackendStatus:
        return self._status

    # -- create ------------------------------------------------------------------------------------

    def _rootfs(self, image: str) -> str:
        if image in ("", "host"):
            return "/"
        if not os.path.isabs(image):
            raise InvalidArgument(f'local image must be "host" or an absolute path to a root filesystem, got {image!r}')
        if not os.path.isdir(image):
            raise InvalidArgument(f"local image {image} is not a directory")
        return os.path.realpath(image)

    def init_argv(self, rootfs: str, sandbox_dir: Path, run_dir: Path, network: bool, uid: int) -> list[str]:
        layout = root_layout(rootfs, self.hidden_paths)
        workdir = self.config.local.workdir
        if self.launcher == "bwrap":
            return bwrap_argv(self.bwrap, layout, sandbox_dir, run_dir, workdir, network)
        return unshare_argv(self.unshare, layout, sandbox_dir, run_dir, workdir, network, uid)

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        if not self._status.available:
            raise FailedPrecondition(f"the local backend cannot make sandboxes here: {self._status.detail}")
        rootfs = self._rootfs(spec.image)
        if not os.path.exists(os.path.join(rootfs, "bin/sh")) and not os.path.islink(os.path.join(rootfs, "bin")):
            raise InvalidArgument(f"image {spec.image} has no /bin/sh")
        uid = self.uids.take()
        sandbox_dir = self.sandboxes_dir / spec.sandbox_id
        runtime = LocalSandbox(self, spec, uid, sandbox_dir)
        try:
            await runtime.start(rootfs)
        except BaseException:
            await runtime.destroy()
            raise
        return runtime

    async def reap(self, record: dict) -> None:
        pid = record.get("launcher_pid")
        if pid and _is_process(pid, ("bwrap", "unshare")):
            _kill(pid)
        await self.cgroups.remove_group(record.get("sandbox_id", ""))
        await remove_sandbox_dirs(record, self.sandboxes_dir, self.run_base)

    async def close(self) -> None:
        try:
            self.run_base.rmdir()
        except OSError:
            pass

    async def reap_orphans(self) -> None:
        for group in self.cgroups.existing_groups():
            await asyncio.to_thread(group.kill)
            await asyncio.to_thread(group.remove)
        for base in (self.sandboxes_dir, self.run_base):
            if base.is_dir():
                for leftover in base.iterdir():
                    await asyncio.to_thread(shutil.rmtree, leftover, True)


def _is_process(pid: int, names: tuple[str, ...]) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in names
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class LocalSandbox(SandboxRuntime):
    isolation = "namespaces"

    def __init__(self, backend: LocalBackend, spec: SandboxSpec, uid: int, sandbox_dir: Path) -> None:
        self.backend = backend
        self.spec = spec
        self.uid = uid
        self.sandbox_dir = sandbox_dir
        self.workdir = backend.config.local.workdir
        self.run_dir = backend.run_base / spec.sandbox_id
        self.limits = backend.status().limits
        self.cgroup: CgroupGroup | None = None
        self.files: SandboxFiles | None = None
        self.init_pid = 0
        self._launcher: subprocess.Popen | None = None
        self._shell = "/bin/sh"

    async def start(self, rootfs: str) -> None:
        for sub in ("workspace", "tmp"):
            path = self.sandbox_dir / sub
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, self.uid, self.uid)
            # Nobody else may list or read it (bubblewrap, root without capabilities, still needs
            # to pass through: hence x for others).
            os.chmod(path, 0o711)
        os.chmod(self.sandbox_dir, 0o711)
        self.sandbox_dir.parent.chmod(0o711)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.run_dir, self.uid, self.uid)
        os.chmod(self.run_dir, 0o700)
        self.run_dir_host = str(self.run_dir)
        self.run_dir_sandbox = RUN_DIR_IN_SANDBOX
        if self.backend.cgroups.can_track:
            lim = self.spec.limits
            try:
                self.cgroup = self.backend.cgroups.create(
                    self.spec.sandbox_id, lim.memory_bytes, lim.pids, lim.cpu_millicores
                )
            except OSError as err:
                raise FailedPrecondition(f"cannot apply the sandbox's limits: {err.strerror} ({err.filename})") from err
        if os.path.exists(os.path.join(rootfs, "bin/bash")):
            self._shell = "/bin/bash"
        if self.backend.launcher == "none":
            self.workdir = str(self.sandbox_dir / "workspace")
            self.run_dir_sandbox = self.run_dir_host
            self.isolation = "none"
            self.files = SandboxFiles("/", self.workdir, self.uid, self.uid, self.backend.config.exec.max_file_bytes)
            return
        argv = self.backend.init_argv(rootfs, self.sandbox_dir, self.run_dir, self.spec.network, self.uid)
        init_cgroup = self.cgroup.leaf("init") if self.cgroup else None
        # Spawned from the event loop thread on purpose: nothing here may die with a worker.
        self._launcher = subprocess.Popen(
            in_cgroup(argv, init_cgroup),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
            cwd="/",
            start_new_session=True,
        )
        ready = await asyncio.wait_for(asyncio.to_thread(self._launcher.stdout.readline), START_TIMEOUT_S)
        if ready != INIT_READY:
            err = await asyncio.to_thread(self._launcher.stderr.read)
            raise FailedPrecondition(
                f"{self.backend.launcher} could not start the sandbox: "
                f"{err.decode(errors='replace').strip() or 'no error output'}"
            )
        self.init_pid = init_pid(self._launcher.pid, 1 if self.backend.launcher == "bwrap" else 2)
        self.files = SandboxFiles(
            f"/proc/{self.init_pid}/root", self.workdir, self.uid, self.uid,
            self.backend.config.exec.max_file_bytes,
        )

    def record(self) -> dict:
        return {
            "backend": "local",
            "sandbox_id": self.spec.sandbox_id,
            "launcher_pid": self._launcher.pid if self._launcher else 0,
            "sandbox_dir": str(self.sandbox_dir),
            "run_dir": str(self.run_dir),
        }

    def alive(self) -> bool:
        if self.isolation == "none":
            return self.files is not None
        return self._launcher is not None and self._launcher.poll() is None

    def shell_argv(self, script: str) -> list[str]:
        return [self._shell, "-c", script]

    def enter_command(self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str]) -> EnterCommand:
        cgroup = self.cgroup.leaf(leaf) if self.cgroup else None
        if self.isolation == "none":
            drop = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--"]
            return EnterCommand([*drop, *inside_env(argv, env)], cgroup, cwd or self.workdir, wrapped=False)
        enter = nsenter_argv(self.backend.nsenter, self.init_pid, self.uid, self.workdir, argv, cwd, env)
        return EnterCommand(enter, cgroup, "/")

    async def destroy(self) -> None:
        if self.cgroup:
            await asyncio.to_thread(self.cgroup.kill)
        if self._launcher:
            for pipe in (self._launcher.stdin, self._launcher.stdout, self._launcher.stderr):
                pipe.close()
            _kill(self._launcher.pid)
            await asyncio.to_thread(self._launcher.wait)
            self._launcher = None
        if self.files:
            self.files.close()
        if self.cgroup:
            await asyncio.to_thread(self.cgroup.remove)
        await asyncio.to_thread(shutil.rmtree, self.sandbox_dir, True)
        await asyncio.to_thread(shutil.rmtree, self.run_dir, True)
        self.backend.uids.give_back(self.uid)

