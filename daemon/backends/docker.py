"""The Docker backend: a sandbox is a container made by the engine (image, limits, network,
init), entered from the host like a local sandbox.

The engine creates and destroys containers through the docker SDK (blocking calls run in a small
thread pool). Commands, shells and kernels do not go through `docker exec` (about 100 ms each
here): the daemon enters the container's namespaces with nsenter (about 3 ms), as the sandbox's
own uid, inside a leaf cgroup created under the container's cgroup, so the engine's memory, pids
and CPU limits still apply and a timeout can kill the whole tree. Files use the same in-root
openat2 access as local sandboxes, through /proc/<container init>/root. That is why this backend
needs the daemon on the engine's host, as root; a remote engine is not supported.

Containers carry labels naming the daemon and the sandbox, so a restarted daemon finds and
removes whatever a crashed one left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cgroups import CgroupDriver, CgroupGroup, LimitSupport
from ..config import Config, parse_ulimit
from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from ..fsaccess import SandboxFiles
from ..uids import UidPool
from .base import (
    RUN_DIR_IN_SANDBOX, Backend, BackendStatus, EnteredSandbox, EnterCommand, SandboxRuntime, SandboxSpec,
    remove_sandbox_dirs,
)
from .nsenter import nsenter_argv

log = logging.getLogger(__name__)

LABEL_DAEMON = "io.corral.daemon"
LABEL_SANDBOX = "io.corral.sandbox"
ENGINE_THREADS = 8


def _docker():
    import docker  # imported lazily: only nodes that use this backend need the package

    return docker


def _engine_name(version: dict) -> str:
    """"docker engine 20.10.24" or "podman engine 4.3.1", from the engine's /version reply."""
    podman = any("podman" in str(c.get("Name", "")).lower() for c in version.get("Components") or [])
    return f"{'podman' if podman else 'docker'} engine {version.get('Version', '?')}"


class DockerBackend(Backend):
    name = "docker"

    def __init__(self, config: Config, cgroups: CgroupDriver, daemon_id: str, run_base: Path, uids: UidPool) -> None:
        self.config = config
        self.cgroups = cgroups
        self.daemon_id = daemon_id
        self.run_base = run_base
        self.uids = uids
        self.sandboxes_dir = config.state_path / "sandboxes"
        self.nsenter = shutil.which("nsenter")
        self._pool = ThreadPoolExecutor(ENGINE_THREADS, thread_name_prefix="docker-engine")
        self._client = None
        self._unreachable = False
        self._status = self._probe()

    @property
    def address(self) -> str:
        return self.config.docker.socket or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"

    def _probe(self) -> BackendStatus:
        limits = {
            "memory": LimitSupport(True, "docker engine (container cgroup)"),
            "pids": LimitSupport(True, "docker engine (container cgroup)"),
            "cpu": LimitSupport(True, "docker engine (container cgroup)"),
            "wall_clock": LimitSupport(True, "process group + leaf cgroup kill"),
            "network": LimitSupport(True, 'docker network mode "none"'),
        }
        try:
            docker = _docker()
        except ImportError:
            return BackendStatus(False, "the docker Python package is not installed (pip install 'corral[docker]')", "none", limits)
        problems = []
        self._unreachable = False
        if os.geteuid() != 0:
            problems.append("the daemon is not root: it enters containers with nsenter")
        if not self.nsenter:
            problems.append("nsenter is not installed (apt-get install util-linux)")
        try:
            self._client = docker.DockerClient(base_url=self.address, timeout=60)
            version = _engine_name(self._client.version())
        except docker.errors.DockerException as err:
            problems.append(f"cannot reach the Docker engine at {self.address}: {err}")
            self._unreachable = True
            version = ""
        if problems:
            return BackendStatus(False, "; ".join(problems), "none", limits)
        return BackendStatus(True, f"{version} at {self.address}", "container", limits)

    def status(self) -> BackendStatus:
        return self._status

    async def _engine(self, fn, *args, **kwargs):
        """Runs a blocking docker SDK call in the engine pool, with engine errors mapped."""
        docker = _docker()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        except docker.errors.NotFound as err:
            raise NotFound(str(err.explanation or err)) from err
        except docker.errors.APIError as err:
            raise FailedPrecondition(f"docker engine: {err.explanation or err}") from err
        except docker.errors.DockerException as err:
            raise Unavailable(f"cannot reach the Docker engine at {self.address}: {err}") from err

    async def _image(self, image: str):
        docker = _docker()
        if not image or image == "host":
            raise InvalidArgument('the docker backend needs an image name (e.g. "debian:bookworm")')
        try:
            return await self._engine(self._client.images.get, image)
        except NotFound:
            if not self.config.docker.pull:
                raise NotFound(
                    f"image {image!r} is not present on this node's Docker engine; build or load it "
                    "(docker build / docker load), or set docker.pull = true to pull from a registry"
                ) from None
        try:
            return await self._engine(self._client.images.pull, image)
        except (NotFound, FailedPrecondition, docker.errors.DockerException) as err:
            raise NotFound(f"image {image!r} could not be pulled: {err}") from err

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        if not self._status.available:
            # The engine may have come up since the daemon started: look again before refusing.
            self._status = await asyncio.get_running_loop().run_in_executor(self._pool, self._probe)
        if not self._status.available:
            if self._unreachable:
                raise Unavailable(f"the docker backend cannot make sandboxes now: {self._status.detail}")
            raise FailedPrecondition(f"the docker backend cannot make sandboxes here: {self._status.detail}")
        await self._image(spec.image)
        sandbox = DockerSandbox(self, spec, self.uids.take())
        try:
            await sandbox.start()
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def reap(self, record: dict) -> None:
        await self._remove_containers({LABEL_SANDBOX: record.get("sandbox_id", "")})
        await remove_sandbox_dirs(record, self.sandboxes_dir, self.run_base)

    async def reap_orphans(self) -> None:
        if self._status.available:
            await self._remove_containers({})

    async def _remove_containers(self, labels: dict[str, str]) -> None:
        if self._client is None:
            return
        filters = {"label": [f"{LABEL_DAEMON}={self.daemon_id}", *(f"{k}={v}" for k, v in labels.items())]}
        for container in await self._engine(self._client.containers.list, all=True, filters=filters):
            log.info("removing leftover container %s", container.name)
            try:
                await self._engine(container.remove, force=True)
            except (NotFound, FailedPrecondition):
                pass

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()


class DockerSandbox(EnteredSandbox):
    isolation = "container"

    def __init__(self, backend: DockerBackend, spec: SandboxSpec, uid: int) -> None:
        self.backend = backend
        self.spec = spec
        self.uid = uid
        self.workdir = backend.config.local.workdir
        self.limits = backend.status().limits
        self.sandbox_dir = backend.sandboxes_dir / spec.sandbox_id
        self.run_dir = backend.run_base / spec.sandbox_id
        self.run_dir_host = str(self.run_dir)
        self.run_dir_sandbox = RUN_DIR_IN_SANDBOX
        self.container = None
        self.init_pid = 0
        self.cgroup: CgroupGroup | None = None
        self.files: SandboxFiles | None = None

    async def start(self) -> None:
        workspace = self.sandbox_dir / "workspace"
        for path in (workspace, self.run_dir):
            path.mkdir(parents=True, exist_ok=True)
            os.chown(path, self.uid, self.uid)
        os.chmod(self.run_dir, 0o700)
        lim = self.spec.limits
        kwargs = dict(
            command=["sleep", "infinity"],
            detach=True,
            init=True,  # an init that reaps orphans as pid 1
            name=f"corral-{self.backend.daemon_id}-{self.spec.sandbox_id}",
            hostname="corral",
            labels={LABEL_DAEMON: self.backend.daemon_id, LABEL_SANDBOX: self.spec.sandbox_id},
            network_mode="bridge" if self.spec.network else "none",
            volumes={
                str(workspace): {"bind": self.workdir, "mode": "rw"},
                str(self.run_dir): {"bind": RUN_DIR_IN_SANDBOX, "mode": "rw"},
            },
            working_dir=self.workdir,
            environment=self.spec.env,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
        )
        if self.backend.config.docker.ulimits:
            ulimit = _docker().types.Ulimit
            kwargs.update(ulimits=[ulimit(name=name, soft=soft, hard=hard)
                                   for name, soft, hard in map(parse_ulimit, self.backend.config.docker.ulimits)])
        if lim.memory_bytes:
            kwargs.update(mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes)
        if lim.pids:
            kwargs.update(pids_limit=lim.pids)
        if lim.cpu_millicores:
            kwargs.update(nano_cpus=lim.cpu_millicores * 1_000_000)
        client = self.backend._client
        try:
            self.container = await self.backend._engine(client.containers.run, self.spec.image, **kwargs)
        except BaseException:
            # A container the engine created but could not start must not outlive the error.
            with contextlib.suppress(Exception):
                leftover = await self.backend._engine(client.containers.get, kwargs["name"])
                await self.backend._engine(leftover.remove, force=True)
            raise
        await self.backend._engine(self.container.reload)
        self.init_pid = int(self.container.attrs["State"]["Pid"])
        if not self.init_pid:
            raise FailedPrecondition(f"container of {self.spec.image!r} is not running: {self.container.status}")
        self.cgroup = self.backend.cgroups.group_of(self.init_pid)
        self.open_files(self.uid, self.backend.config.exec.max_file_bytes)

    def record(self) -> dict:
        return {
            "backend": "docker",
            "sandbox_id": self.spec.sandbox_id,
            "container_id": self.container.id if self.container else "",
            "sandbox_dir": str(self.sandbox_dir),
            "run_dir": str(self.run_dir),
        }

    def enter_command(self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str]) -> EnterCommand:
        cgroup = self.cgroup.leaf(f"corral-{leaf}") if self.cgroup else None
        enter = nsenter_argv(self.backend.nsenter, self.init_pid, self.uid, self.workdir, argv, cwd, env)
        return EnterCommand(enter, cgroup, "/")

    async def destroy(self) -> None:
        if self.cgroup:
            # Only our leaves: the engine removes the container's own cgroup, which it refuses
            # to do while directories we made are still in it.
            for leaf in self._our_leaves():
                await asyncio.to_thread(leaf.kill)
                await asyncio.to_thread(leaf.remove)
        if self.files:
            self.files.close()
        if self.container is not None:
            try:
                await self.backend._engine(self.container.remove, force=True)
            except (NotFound, FailedPrecondition, Unavailable) as err:
                log.warning("could not remove container of %s: %s", self.spec.sandbox_id, err)
            self.container = None
        await asyncio.to_thread(shutil.rmtree, self.sandbox_dir, True)
        await asyncio.to_thread(shutil.rmtree, self.run_dir, True)
        self.backend.uids.give_back(self.uid)

    def _our_leaves(self) -> list[CgroupGroup]:
        first = self.cgroup.paths[0]
        names = [p.name for p in first.iterdir() if p.is_dir() and p.name.startswith("corral-")] if first.is_dir() else []
        return [CgroupGroup([p / n for p in self.cgroup.paths], self.cgroup.hierarchies) for n in names]
