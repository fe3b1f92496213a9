"""The Singularity/Apptainer backend: a sandbox is an instance (`instance start`) of a SIF file or
sandbox directory, entered from the host like a local sandbox.

`apptainer instance start --containall --no-home --overlay DIR --net --network none` makes the
namespaces (mount, pid, ipc, net), the root (the image under a writable overlay of the sandbox's
own, in its disk-capped directory) and the mounts; the daemon starts it inside the sandbox's
cgroup, so its limits hold for everything the instance runs, makes the kernel's settings under
/proc and /sys read-only in it as Docker does, and enters the instance's namespaces
(container_enter.py) as root inside, or the user a request names, for commands, shells and
kernels, with Docker's default capabilities for root, no_new_privs and a seccomp filter. Files go
through /proc/<instance init>/root, as for the other backends. Instance names carry the daemon's
id, so a restarted daemon finds and stops leftovers.
Works with either binary name, `apptainer` or `singularity`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound

from ..cgroups import CgroupGroup, LimitSupport
from ..process import in_cgroup
from .base import RUN_DIR_IN_SANDBOX, Backend, BackendStatus
from .container_enter import CAPABILITY_MASK, HOST_NETWORK_CAPABILITY_MASK, ImageUserSandbox, read_only_argv
from .idmapped_binds import check_shown, release_staging, stage, staging_dir, staging_root, unstage, unstage_all
from .nsenter import HOST_ENV

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
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

    def validate(self) -> None:
        if self.default_image and not os.path.isabs(self.default_image):
            raise ValueError("default_image must be an absolute path")


class SingularitySandbox(ImageUserSandbox):
    isolation = "container"
    # The image's writable overlay and the workspace are in the sandbox directory, and --containall
    # gives /tmp and /var/tmp in-memory tmpfs mounts (charged to the sandbox's memory cgroup): all
    # it can write to the host's disk is on the sandbox's own filesystem.
    caps_disk = True

    @property
    def capabilities(self) -> int:
        # Without --net the instance shares the host's network namespace.
        return HOST_NETWORK_CAPABILITY_MASK if self.spec.network else CAPABILITY_MASK

    @property
    def overlay(self) -> str:
        """The directory of the image's writable overlay (apptainer makes `upper` and `work` in it)."""
        return str(self.sandbox_dir / "overlay")

    backend: SingularityBackend

    def __init__(self, backend: SingularityBackend, spec, uid: int) -> None:
        super().__init__(backend, spec, uid)
        self.name = backend.instance_name(spec.sandbox_id)
        self.bind_staging = staging_dir(self.context.state_dir, backend.name, spec.sandbox_id)
        self._started = False

    async def launch(self) -> None:
        binary = self.backend.binary
        assert binary is not None
        os.mkdir(self.overlay, 0o700)
        argv = [
            binary,
            "instance",
            "start",
            "--containall",
            "--no-home",
            "--hostname",
            "corral",
            "--bind",
            f"{self.workspace}:{self.workdir}",
            "--bind",
            f"{self.run_dir}:{RUN_DIR_IN_SANDBOX}",
            "--overlay",
            self.overlay,
            # The site's `bind path` entries (by default the host's /etc/localtime, read-write):
            # root inside is host uid 0, so it gets only the binds corral makes.
            "--no-mount",
            "bind-paths",
        ]
        for mount in self.spec.mounts:
            if any(c in mount.sandbox_path for c in BIND_SEPARATORS):
                raise InvalidArgument(f"mount {mount.sandbox_path}: apptainer cannot bind a path with ':' or ','")
        # Apptainer binds idmapped staging mounts of the host paths (idmapped_binds.py), whose
        # paths are the daemon's own (a host path with ':' or ',' is fine).
        for mount in await asyncio.to_thread(stage, self.spec.mounts, self.uid, self.bind_staging):
            argv += ["--bind", f"{mount.host_path}:{mount.sandbox_path}:{'ro' if mount.read_only else 'rw'}"]
        if not self.spec.network:
            argv += ["--net", "--network", "none"]
        argv += [self.spec.image, self.name]
        self._started = True
        code, out = await _run(argv, START_TIMEOUT_S, self.cgroup.leaf("init") if self.cgroup else None)
        if code != 0:
            raise FailedPrecondition(f"{os.path.basename(binary)} could not start the instance: {out}")
        found = [i for i in await self.backend.instances() if i.get("instance") == self.name]
        if not found or not found[0].get("pid"):
            raise FailedPrecondition(f"instance {self.name} started but is not listed: {out}")
        self.init_pid = int(found[0]["pid"])
        code, out = await _run(read_only_argv(self.init_pid), START_TIMEOUT_S)
        if code != 0:
            raise FailedPrecondition(f"cannot make the kernel's settings read-only in instance {self.name}: {out}")
        await asyncio.to_thread(check_shown, self.spec.mounts, self.uid, self.init_pid)
        self.adopt_user("")

    async def shutdown(self) -> None:
        if self._started:
            self._started = False
            await self.backend.stop_instance(self.name)  # removes apptainer's own instance record
        await asyncio.to_thread(unstage, self.bind_staging)

    def record_extra(self) -> dict:
        return {"instance": self.name}


class SingularityBackend(Backend):
    name = "singularity"
    Settings = SingularitySettings
    sandbox_class = SingularitySandbox

    settings: SingularitySettings

    def __init__(self, context) -> None:
        self.binary = shutil.which("apptainer") or shutil.which("singularity")
        super().__init__(context)

    def probe(self) -> BackendStatus:
        cgroups = self.context.cgroups
        limits = {
            "memory": cgroups.support("memory"),
            "pids": cgroups.support("pids"),
            "cpu": cgroups.support("cpu"),
            "wall_clock": LimitSupport(True, "process group + cgroup kill"),
            "network": LimitSupport(True, "instance network namespace (--net --network none)"),
            "disk": LimitSupport(
                self.disk_support.enforced,
                f"workspace: {self.disk_support.mechanism}; /tmp and /var/tmp: apptainer's in-memory "
                "tmpfs, counted against the memory limit instead",
                self.disk_support.reason,
            ),
        }
        problems = []
        if not self.binary:
            problems.append("neither apptainer nor singularity is installed")
        if os.geteuid() != 0:
            problems.append("the daemon is not root: it enters instances' namespaces itself")
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
        return BackendStatus(True, f"{os.path.basename(self.binary)} {version}", "container", limits)

    def default_image(self) -> str:
        return self.settings.default_image

    def instance_name(self, sandbox_id: str) -> str:
        return f"corral-{self.context.daemon_id}-{sandbox_id}"

    async def check_image(self, image: str) -> None:
        if not image or image == "host" or not os.path.isabs(image):
            raise InvalidArgument("the singularity backend needs the absolute path of a SIF file or sandbox directory")
        if not os.path.exists(image):
            raise NotFound(f"image {image} does not exist on this node")

    async def instances(self) -> list[dict]:
        assert self.binary is not None
        code, out = await _run([self.binary, "instance", "list", "--json"], 30)
        if code != 0:
            return []
        try:
            return json.loads(out).get("instances") or []
        except ValueError:
            return []

    async def stop_instance(self, name: str) -> None:
        assert self.binary is not None
        await _run([self.binary, "instance", "stop", "--signal", "SIGKILL", name], 30)

    async def release(self, record: dict) -> None:
        if self.binary and record.get("instance"):
            await self.stop_instance(record["instance"])
        await asyncio.to_thread(release_staging, self.context.state_dir, self.name, record)

    async def reap_orphans(self) -> None:
        if self._status.available:
            prefix = f"corral-{self.context.daemon_id}-"
            for instance in await self.instances():
                if instance.get("instance", "").startswith(prefix):
                    log.info("stopping leftover instance %s", instance["instance"])
                    await self.stop_instance(instance["instance"])
        await asyncio.to_thread(unstage_all, staging_root(self.context.state_dir, self.name))
