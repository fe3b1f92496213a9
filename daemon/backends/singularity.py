"""The Singularity/Apptainer backend: a sandbox is an instance (`instance start`) of a SIF file or
sandbox directory, entered from the host like a local sandbox.

`apptainer instance start --containall --no-home --net --network none` makes the namespaces
(mount, pid, ipc, net) and the root; the daemon starts it inside the sandbox's cgroup, so its
limits hold for everything the instance runs, and enters the instance's namespaces with nsenter
as the sandbox's own uid for commands, shells and kernels (the instance's init stays root, as
apptainer runs it). Files go through /proc/<instance init>/root, as for the other backends.
Instance names carry the daemon's id, so a restarted daemon finds and stops leftovers.
Works with either binary name, `apptainer` or `singularity`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..cgroups import CgroupDriver, CgroupGroup, LimitSupport
from ..config import Config
from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound
from ..fsaccess import SandboxFiles
from ..process import in_cgroup
from ..uids import UidPool
from .base import (
    RUN_DIR_IN_SANDBOX, Backend, BackendStatus, EnteredSandbox, EnterCommand, SandboxRuntime, SandboxSpec,
    remove_sandbox_dirs,
)
from .nsenter import HOST_ENV, nsenter_argv

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
# The working directory apptainer gives an instance's init (the one nsenter -w would inherit);
# commands always change to their own cwd, by default the sandbox's workdir.
INSTANCE_CWD = "/root"


async def _run(argv: list[str], timeout: float, cgroup: CgroupGroup | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *in_cgroup(argv, cgroup), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(HOST_ENV),
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"timed out after {timeout:g}s"
    return proc.returncode, out.decode(errors="replace").strip()


class SingularityBackend(Backend):
    name = "singularity"

    def __init__(self, config: Config, cgroups: CgroupDriver, daemon_id: str, run_base: Path, uids: UidPool) -> None:
        self.config = config
        self.cgroups = cgroups
        self.daemon_id = daemon_id
        self.run_base = run_base
        self.uids = uids
        self.sandboxes_dir = config.state_path / "sandboxes"
        self.binary = shutil.which("apptainer") or shutil.which("singularity")
        self.nsenter = shutil.which("nsenter")
        self._status = self._probe()

    def _probe(self) -> BackendStatus:
        limits = {
            "memory": self.cgroups.support("memory"),
            "pids": self.cgroups.support("pids"),
            "cpu": self.cgroups.support("cpu"),
            "wall_clock": LimitSupport(True, "process group + cgroup kill"),
            "network": LimitSupport(True, "instance network namespace (--net --network none)"),
        }
        problems = []
        if not self.binary:
            problems.append("neither apptainer nor singularity is installed")
        if not self.nsenter:
            problems.append("nsenter is not installed (apt-get install util-linux)")
        if os.geteuid() != 0:
            problems.append("the daemon is not root: it enters instances with nsenter")
        version = ""
        if self.binary:
            try:
                version = subprocess.run([self.binary, "version"], capture_output=True, text=True, timeout=10).stdout.strip()
            except (OSError, subprocess.SubprocessError) as err:
                problems.append(f"{self.binary} does not run: {err}")
        if problems:
            return BackendStatus(False, "; ".join(problems), "none", limits)
        return BackendStatus(True, f"{os.path.basename(self.binary)} {version}", "container", limits)

    def status(self) -> BackendStatus:
        return self._status

    def instance_name(self, sandbox_id: str) -> str:
        return f"corral-{self.daemon_id}-{sandbox_id}"

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        if not self._status.available:
            raise FailedPrecondition(f"the singularity backend cannot make sandboxes here: {self._status.detail}")
        if not spec.image or spec.image == "host" or not os.path.isabs(spec.image):
            raise InvalidArgument("the singularity backend needs the absolute path of a SIF file or sandbox directory")
        if not os.path.exists(spec.image):
            raise NotFound(f"image {spec.image} does not exist on this node")
        sandbox = SingularitySandbox(self, spec, self.uids.take())
        try:
            await sandbox.start()
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def _instances(self) -> list[dict]:
        code, out = await _run([self.binary, "instance", "list", "--json"], 30)
        if code != 0:
            return []
        try:
            return json.loads(out).get("instances") or []
        except ValueError:
            return []

    async def stop_instance(self, name: str) -> None:
        await _run([self.binary, "instance", "stop", "--signal", "SIGKILL", name], 30)

    async def reap(self, record: dict) -> None:
        await self.stop_instance(record.get("instance", ""))
        await self.cgroups.remove_group(record.get("sandbox_id", ""))
        await remove_sandbox_dirs(record, self.sandboxes_dir, self.run_base)

    async def reap_orphans(self) -> None:
        if not self._status.available:
            return
        prefix = f"corral-{self.daemon_id}-"
        for instance in await self._instances():
            if instance.get("instance", "").startswith(prefix):
                log.info("stopping leftover instance %s", instance["instance"])
                await self.stop_instance(instance["instance"])


class SingularitySandbox(EnteredSandbox):
    isolation = "container"

    def __init__(self, backend: SingularityBackend, spec: SandboxSpec, uid: int) -> None:
        self.backend = backend
        self.spec = spec
        self.uid = uid
        self.name = backend.instance_name(spec.sandbox_id)
        self.workdir = backend.config.local.workdir
        self.limits = backend.status().limits
        self.sandbox_dir = backend.sandboxes_dir / spec.sandbox_id
        self.run_dir = backend.run_base / spec.sandbox_id
        self.run_dir_host = str(self.run_dir)
        self.run_dir_sandbox = RUN_DIR_IN_SANDBOX
        self.init_pid = 0
        self.cgroup: CgroupGroup | None = None
        self.files: SandboxFiles | None = None
        self._started = False

    async def start(self) -> None:
        workspace = self.sandbox_dir / "workspace"
        for path in (workspace, self.run_dir):
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, self.uid, self.uid)
            os.chmod(path, 0o711 if path == workspace else 0o700)
        if self.backend.cgroups.can_track:
            lim = self.spec.limits
            try:
                self.cgroup = self.backend.cgroups.create(
                    self.spec.sandbox_id, lim.memory_bytes, lim.pids, lim.cpu_millicores
                )
            except OSError as err:
                raise FailedPrecondition(f"cannot apply the sandbox's limits: {err.strerror} ({err.filename})") from err
        argv = [
            self.backend.binary, "instance", "start", "--containall", "--no-home",
            "--hostname", "corral",
            "--bind", f"{workspace}:{self.workdir}",
            "--bind", f"{self.run_dir}:{RUN_DIR_IN_SANDBOX}",
        ]
        if not self.spec.network:
            argv += ["--net", "--network", "none"]
        argv += [self.spec.image, self.name]
        self._started = True
        code, out = await _run(argv, START_TIMEOUT_S, self.cgroup.leaf("init") if self.cgroup else None)
        if code != 0:
            raise FailedPrecondition(f"{os.path.basename(self.backend.binary)} could not start the instance: {out}")
        found = [i for i in await self.backend._instances() if i.get("instance") == self.name]
        if not found or not found[0].get("pid"):
            raise FailedPrecondition(f"instance {self.name} started but is not listed: {out}")
        self.init_pid = int(found[0]["pid"])
        self.open_files(self.uid, self.backend.config.exec.max_file_bytes)

    def record(self) -> dict:
        return {
            "backend": "singularity",
            "sandbox_id": self.spec.sandbox_id,
            "instance": self.name,
            "sandbox_dir": str(self.sandbox_dir),
            "run_dir": str(self.run_dir),
        }

    def enter_command(self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str]) -> EnterCommand:
        cgroup = self.cgroup.leaf(leaf) if self.cgroup else None
        enter = nsenter_argv(self.backend.nsenter, self.init_pid, self.uid, INSTANCE_CWD, argv, cwd or self.workdir, env)
        return EnterCommand(enter, cgroup, "/")

    async def destroy(self) -> None:
        if self.cgroup:
            await asyncio.to_thread(self.cgroup.kill)
        if self.files:
            self.files.close()
        if self._started:
            await self.backend.stop_instance(self.name)  # removes apptainer's own instance record
        if self.cgroup:
            await asyncio.to_thread(self.cgroup.remove)
        await asyncio.to_thread(shutil.rmtree, self.sandbox_dir, True)
        await asyncio.to_thread(shutil.rmtree, self.run_dir, True)
        self.backend.uids.give_back(self.uid)
