"""The Docker backend: a sandbox is a container made by the engine (image, limits, network,
init, writable layer), entered from the host like a local sandbox.

The engine creates and destroys containers through the docker SDK (blocking calls run in a small
thread pool). Commands, shells and kernels do not go through `docker exec` (about 100 ms each
here): the daemon enters the container's namespaces itself (container_enter.py), as the image's
user (root for most images) with Docker's default capabilities for root less CAP_MKNOD,
no_new_privs and a seccomp filter, inside a leaf cgroup created under the container's cgroup (and
its devices cgroup), so the engine's memory, pids, CPU and device limits still apply and a
timeout can kill the whole tree. Files use the same in-root openat2 access as local sandboxes,
through /proc/<container init>/root, as the same user. That is why this backend needs the daemon
on the engine's host, as root; a remote engine is not supported.

With `docker.storage = "btrfs"` (and "auto", the default, wherever the node can have it) the
sandbox's directory is a subvolume of the node's btrfs pool, capped at limits.disk_bytes
(storage.py), and the container's writable layer is placed in it before the container starts
(engine_layer.py): one limit covers the workspace and every write to the container's root, and
ForkSandbox snapshots both.

Containers carry labels naming the daemon and the sandbox, so a restarted daemon finds and
removes whatever a crashed one left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from corral.sdk.errors import CorralError, FailedPrecondition, InvalidArgument, NotFound, Unavailable

from ...cgroups import CgroupGroup, LimitSupport, v1_cpu_shares
from ...diskcap import unmount
from ..base import NOT_ROOT, RUN_DIR_IN_SANDBOX, Backend, BackendStatus, CannotFork, ForkPoint, SandboxRuntime
from ..container_enter import ImageUserSandbox
from ..idmapped_binds import check_shown, release_staging, stage, staging_dir, staging_root, unstage, unstage_all
from ..storage import (
    SnapshotStore,
    StoragePool,
    bind_subvolume,
    delete_subvolume,
    make_subvolume,
    node_pool,
    snapshot_paused,
)
from . import engine_layer

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

log = logging.getLogger(__name__)

LABEL_DAEMON = "io.corral.daemon"
LABEL_SANDBOX = "io.corral.sandbox"
ENGINE_THREADS = 8
# GetNodeInfo waits this long at most for the engine's list of images.
ENGINE_LIST_TIMEOUT_S = 2.0
# What the probe says is missing, and what `corral doctor` says to do about it (own_fixes).
NO_PACKAGE = "the docker Python package is not installed"
UNREACHABLE = "cannot reach the Docker engine"
FIX_DOCKER_PACKAGE = "pip install 'corral[docker]'"
FIX_DOCKER_ENGINE = (
    "start the Docker engine (systemctl start docker; apt-get install docker.io where there is none), "
    "or point docker.socket / $DOCKER_HOST at a running one"
)


def _docker():
    import docker  # imported lazily: only nodes that use this backend need the package

    return docker


def _engine_name(version: dict) -> str:
    """ "docker engine 20.10.24" or "podman engine 4.3.1", from the engine's /version reply."""
    podman = any("podman" in str(c.get("Name", "")).lower() for c in version.get("Components") or [])
    return f"{'podman' if podman else 'docker'} engine {version.get('Version', '?')}"


@dataclass
class DockerSettings:
    """The [docker] configuration section."""

    socket: str = ""  # empty: $DOCKER_HOST, else unix:///var/run/docker.sock
    pull: bool = False  # pull images missing locally (no registry is assumed by default)
    default_image: str = ""  # the image of requests that name none
    # Process rlimits for every container, "name=soft[:hard]" (e.g. "nofile=65536"); empty: the
    # engine's defaults. Podman sets nofile and nproc to 1048576 unless told otherwise, which
    # fails where root cannot raise rlimits that far (e.g. inside a user namespace).
    ulimits: list[str] = field(default_factory=list)
    # "engine": the container's writable layer is the engine's (not capped); "btrfs": it and the
    # workspace are on a subvolume of the node's btrfs pool capped at limits.disk_bytes, which
    # ForkSandbox needs (engine_layer.py, storage.py); the pool is an image of storage_bytes
    # (0: the size of the state directory's disk, sparse), shared with local.storage = "btrfs".
    # "auto": "btrfs" where the node and the engine can have it, else "engine", saying why.
    storage: str = "auto"
    storage_bytes: int = 0
    # What named snapshots (SnapshotSandbox) of docker sandboxes may hold together.
    snapshot_store_bytes: int = 64 << 30

    def validate(self) -> None:
        for entry in self.ulimits:
            parse_ulimit(entry)
        if self.storage not in STORAGE_KINDS:
            raise ValueError(f"storage must be one of {', '.join(STORAGE_KINDS)}")
        if self.storage_bytes < 0:
            raise ValueError("storage_bytes must be 0 (the state disk's size) or positive")
        if self.snapshot_store_bytes < 0:
            raise ValueError("snapshot_store_bytes must be 0 (no named snapshots) or positive")


STORAGE_KINDS = ("auto", "btrfs", "engine")


def parse_ulimit(entry: str) -> tuple[str, int, int]:
    """ "name=soft[:hard]" -> (name, soft, hard); hard defaults to soft. ValueError naming the key
    (docker.ulimits) otherwise."""
    name, sep, values = entry.partition("=")
    soft, _, hard = values.partition(":")
    try:
        if not (sep and name.strip() and soft):
            raise ValueError
        parsed = (name.strip(), int(soft), int(hard or soft))
    except ValueError:
        raise ValueError(f'ulimits entry {entry!r} is not "name=soft[:hard]" (e.g. "nofile=65536:65536")') from None
    if parsed[1] > parsed[2]:
        raise ValueError(f"ulimits entry {entry!r}: the soft limit exceeds the hard one")
    return parsed


PID1_LOOP = "trap '' HUP INT TERM; while :; do sleep 2147483647 & wait; done"


class DockerSandbox(ImageUserSandbox):
    isolation = "container"
    owns_cgroup = False  # the engine's container cgroup: the daemon only adds leaves to it
    join_devices_cgroup = True
    leaf_prefix = "corral-"
    # The workspace stays listable for users of the image other than its owner.
    dir_mode = 0o755

    backend: DockerBackend

    def __init__(self, backend: DockerBackend, spec, uid: int) -> None:
        super().__init__(backend, spec, uid)
        self.container: Container | None = None
        self.container_name = f"corral-{self.context.daemon_id}-{spec.sandbox_id}"
        self.bind_staging = staging_dir(self.context.state_dir, backend.name, spec.sandbox_id)
        # With the btrfs pool: the sandbox's subvolume, and the engine's layer directory bound to
        # its `layer/` (engine_layer.py).
        self.subvolume: Path | None = None
        self.layer_dir: Path | None = None

    async def mount_writable(self) -> None:
        pool = self.backend.pool
        if pool is not None:
            await asyncio.to_thread(self._mount_subvolume, pool)

    def _mount_subvolume(self, pool: StoragePool) -> None:
        fork = self.spec.fork
        self.subvolume = make_subvolume(
            pool, self.spec.sandbox_id, fork.path if fork else "", self.spec.limits.disk_bytes
        )
        # (Inside ids are the host's: nothing to map, whoever wrote the files.)
        bind_subvolume(self.subvolume, self.sandbox_dir, self.uid, self.uid, 1)

    async def launch(self) -> None:
        backend = self.backend
        settings = backend.settings
        lim = self.spec.limits
        kwargs = dict(
            # pid 1 is this shell itself, not an init whose child keeps the container up: root
            # inside may `kill -9 -1` (the evaluation does), which spares only pid 1, and the
            # kernel ignores SIGKILL sent to a pid namespace's init from inside. Its `wait`
            # reaps orphans (waitpid(-1)) while its sleep lasts; a killed sleep is replaced.
            command=["/bin/sh", "-c", PID1_LOOP],
            init=False,
            name=self.container_name,
            hostname="corral",
            labels={LABEL_DAEMON: self.context.daemon_id, LABEL_SANDBOX: self.spec.sandbox_id},
            network_mode="bridge" if self.spec.network else "none",
            volumes={
                str(self.workspace): {"bind": self.workdir, "mode": "rw"},
                str(self.run_dir): {"bind": RUN_DIR_IN_SANDBOX, "mode": "rw"},
            },
            working_dir=self.workdir,
            environment=self.spec.env,
            # The init (sleep) needs nothing; what corral runs is entered with its own capabilities.
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
        )
        if self.spec.mounts:
            # The engine binds idmapped staging mounts of the host paths (idmapped_binds.py).
            staged = await asyncio.to_thread(stage, self.spec.mounts, self.uid, self.bind_staging)
            mount = _docker().types.Mount
            kwargs.update(
                mounts=[mount(m.sandbox_path, m.host_path, type="bind", read_only=m.read_only) for m in staged]
            )
        if settings.ulimits:
            ulimit = _docker().types.Ulimit
            kwargs.update(
                ulimits=[
                    ulimit(name=name, soft=soft, hard=hard) for name, soft, hard in map(parse_ulimit, settings.ulimits)
                ]
            )
        if lim.memory_bytes:
            kwargs.update(mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes)
        if lim.pids:
            kwargs.update(pids_limit=lim.pids)
        if lim.cpu_millicores:
            kwargs.update(nano_cpus=lim.cpu_millicores * 1_000_000)
        if self.context.cgroups.sandbox_cpu_weight:
            kwargs.update(cpu_shares=v1_cpu_shares(self.context.cgroups.sandbox_cpu_weight))
        if self.context.cgroups.oom_score_adj:
            kwargs.update(oom_score_adj=self.context.cgroups.oom_score_adj)
        client = backend.engine_client
        try:
            container: Container = await backend.engine(client.containers.create, self.spec.image, **kwargs)
            self.container = container
            if self.subvolume is not None:
                self.layer_dir = engine_layer.layer_dir(container.attrs)
                await asyncio.to_thread(
                    engine_layer.place, self.layer_dir, self.sandbox_dir, self.spec.fork is not None
                )
            await backend.engine(container.start)
        except BaseException:
            # A container the engine created but could not start must not outlive the error.
            with contextlib.suppress(Exception):
                leftover = await backend.engine(client.containers.get, self.container_name)
                await backend.remove_container(leftover, self.layer_dir)
            self.container = self.layer_dir = None
            raise
        await backend.engine(container.reload)
        self.init_pid = int(container.attrs["State"]["Pid"])
        if not self.init_pid:
            raise FailedPrecondition(f"container of {self.spec.image!r} is not running: {container.status}")
        self.cgroup = self.context.cgroups.group_of(self.init_pid)
        if self.layer_dir is not None:
            await asyncio.to_thread(engine_layer.check_used, self.init_pid, self.sandbox_dir)
        await asyncio.to_thread(check_shown, self.spec.mounts, self.uid, self.init_pid)
        self.adopt_user(container.attrs["Config"].get("User") or "")

    async def kill_processes(self) -> None:
        # Only our leaves: the engine removes the container's own cgroup, which it refuses to do
        # while directories we made are still in it.
        if self.cgroup:
            for leaf in self._our_leaves():
                await asyncio.to_thread(leaf.kill)
                await asyncio.to_thread(leaf.remove)

    async def shutdown(self) -> None:
        container, self.container = self.container, None
        if container is not None:
            try:
                await self.backend.remove_container(container, self.layer_dir)
            except (NotFound, FailedPrecondition, Unavailable) as err:
                log.warning("could not remove container of %s: %s", self.spec.sandbox_id, err)
        await asyncio.to_thread(unstage, self.bind_staging)

    async def destroy(self) -> None:
        try:
            await super().destroy()
        except BaseException:
            with contextlib.suppress(OSError):  # (the teardown's own error is the one to report)
                await self._drop_subvolume()
            raise
        await self._drop_subvolume()

    async def _drop_subvolume(self) -> None:
        """Deletes the sandbox's subvolume, also after a teardown that failed half-way; but not
        while the engine's layer directory still shows the sandbox's layer (its container may
        still write there): the subvolume then waits for the next start's reap."""
        subvolume = self.subvolume
        if subvolume is None or (self.layer_dir is not None and os.path.ismount(self.layer_dir)):
            return
        await asyncio.to_thread(unmount, self.sandbox_dir)  # (its bind of the subvolume, if still there)
        await asyncio.to_thread(delete_subvolume, subvolume)
        self.subvolume = None

    def record_extra(self) -> dict:
        return {"container_id": self.container.id if self.container else ""}

    async def fork_point(self, point: Path) -> ForkPoint:
        """Pauses the container (cgroup v2's freezer, else the engine's pause: about 25 ms each
        way), writes its filesystem out and snapshots its subvolume (workspace and writable
        layer) read-only at `point`, then resumes it."""
        assert self.subvolume is not None and self.container is not None  # (checked by the backend)
        cgroup, container = self.cgroup, self.container
        frozen = cgroup is not None and await asyncio.to_thread(cgroup.freeze, True)
        if not frozen:
            await self.backend.engine(container.pause)
        made = False
        try:
            await asyncio.to_thread(snapshot_paused, self.subvolume, point)
            made = True
        finally:
            try:
                if frozen:
                    await asyncio.to_thread(cgroup.freeze, False)  # type: ignore[union-attr]
                else:
                    await self._resume(container)
            except BaseException:
                # The fork fails with the parent's resume (retried in _resume): its snapshot is
                # nobody's to drop, so it goes now rather than at the daemon's next start.
                if made:
                    await asyncio.to_thread(delete_subvolume, point)
                raise
        return ForkPoint(self.spec.sandbox_id, str(point), self.uid)

    async def _resume(self, container: Container) -> None:
        """Unpauses the container, retried while the engine has not yet recorded the pause."""
        for delay in (0.0, 0.05, 0.2, 0.5):
            await asyncio.sleep(delay)
            try:
                await self.backend.engine(container.unpause)
                return
            except FailedPrecondition:
                await self.backend.engine(container.reload)
                if not container.attrs["State"].get("Paused"):
                    return
        raise FailedPrecondition(f"the engine could not resume the container of {self.spec.sandbox_id} after a fork")

    def _our_leaves(self) -> list[CgroupGroup]:
        assert self.cgroup is not None
        first = self.cgroup.paths[0]
        names = (
            [p.name for p in first.iterdir() if p.is_dir() and p.name.startswith("corral-")] if first.is_dir() else []
        )
        return [CgroupGroup([p / n for p in self.cgroup.paths], self.cgroup.hierarchies) for n in names]


def _disk_not_capped(storage_driver: str, storage: str) -> LimitSupport:
    """Why a container's writable space has no cap: its writable layer is the engine's (only the
    engine could cap it, with `--storage-opt size`, which some storage drivers accept: overlay2 on
    xfs with pquota, btrfs, zfs), and the workspace is a host directory the engine binds.
    `storage`: why the layer is the engine's (the setting, or what "auto" found lacking)."""
    return LimitSupport(
        False,
        reason=f"not capped ({storage}): the container's writable layer (storage driver {storage_driver}) "
        "and its bind-mounted workspace can grow until the host's disk is full",
    )


def _storage_driver(info: dict) -> str:
    """The engine's storage driver and the filesystem under it, e.g. "overlay2 on extfs"."""
    driver = info.get("Driver") or "unknown"
    backing = dict(pair for pair in info.get("DriverStatus") or () if len(pair) == 2).get("Backing Filesystem")
    return f"{driver} on {backing}" if backing else driver


class DockerBackend(Backend):
    name = "docker"
    Settings = DockerSettings
    sandbox_class = DockerSandbox

    settings: DockerSettings

    def __init__(self, context) -> None:
        self._pool = ThreadPoolExecutor(ENGINE_THREADS, thread_name_prefix="docker-engine")
        self.client: DockerClient | None = None
        self._unreachable = False
        settings = context.settings
        self.pool = node_pool(context.state_dir, settings.storage_bytes) if settings.storage != "engine" else None
        # Why the layer is the engine's: the setting, or what "auto" found lacking on this node.
        self.engine_storage = 'docker.storage = "engine"' if self.pool is None else ""
        self._driver = "unknown"  # the engine's storage driver, as the last probe found it
        self._pool_open = False
        self._pool_opening = asyncio.Lock()
        self.snapshot_store = SnapshotStore("docker.snapshot_store_bytes", settings.snapshot_store_bytes)
        super().__init__(context)

    @property
    def engine_client(self) -> DockerClient:
        """The engine's client, made by the probe that found the backend available (create checks
        that before anything else)."""
        assert self.client is not None, "the docker backend is not available"
        return self.client

    @property
    def address(self) -> str:
        return self.settings.socket or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"

    def probe(self) -> BackendStatus:
        limits = {
            "memory": LimitSupport(True, "docker engine (container cgroup)"),
            "pids": LimitSupport(True, "docker engine (container cgroup)"),
            "cpu": LimitSupport(True, "docker engine (container cgroup)"),
            "wall_clock": LimitSupport(True, "process group + leaf cgroup kill"),
            "network": LimitSupport(True, 'docker network mode "none"'),
            "disk": _disk_not_capped("unknown", self.engine_storage or "the engine is not reachable"),
        }
        try:
            docker = _docker()
        except ImportError:
            return BackendStatus(False, f"{NO_PACKAGE} (pip install 'corral[docker]')", "none", limits)
        problems = []
        self._unreachable = False
        if os.geteuid() != 0:
            problems.append(f"{NOT_ROOT}: it enters containers' namespaces itself")
        try:
            client = docker.DockerClient(base_url=self.address, timeout=60)
            self.client = client
            version = _engine_name(client.version())
            info = client.info()
            self._driver = _storage_driver(info)
            limits["disk"] = _disk_not_capped(self._driver, self.engine_storage)
        except docker.errors.DockerException as err:
            problems.append(f"{UNREACHABLE} at {self.address}: {err}")
            self._unreachable = True
            version, info = "", {}
        if self.pool is not None and not self._unreachable:
            lacking = self.pool.lacking() or engine_layer.lacking(info, self.address)
            if lacking and self.settings.storage == "auto":
                self._use_engine_storage(lacking)
                limits["disk"] = _disk_not_capped(self._driver, self.engine_storage)
            elif lacking:
                problems.append(f'docker.storage = "btrfs": {lacking}')
            else:
                limits["disk"] = LimitSupport(
                    True,
                    "btrfs subvolume per sandbox (workspace and the container's writable layer), capped by a quota group",
                )
        if problems:
            return BackendStatus(False, "; ".join(problems), "none", limits)
        return BackendStatus(True, f"{version} at {self.address}", "container", limits)

    @classmethod
    def own_fixes(cls, status: BackendStatus) -> list[str]:
        found = [FIX_DOCKER_PACKAGE] if NO_PACKAGE in status.detail else []
        if UNREACHABLE in status.detail:
            found.append(FIX_DOCKER_ENGINE)
        return found

    def _use_engine_storage(self, lacking: str) -> None:
        """docker.storage = "auto" on a node without the pool: containers keep the engine's
        writable layer (not capped, no fork), said once in the log and in the disk limit's
        status (GetNodeInfo, `corral doctor`)."""
        self.pool = None
        self.engine_storage = f'docker.storage = "auto" found no btrfs pool here: {lacking}'
        log.warning(
            "the docker backend keeps containers' writable layers on the engine (not capped by "
            "limits.disk_bytes; ForkSandbox unavailable): %s",
            self.engine_storage,
        )

    def default_image(self) -> str:
        return self.settings.default_image

    async def cached_images(self) -> list[str]:
        """The engine's tagged images (one engine call; none when the engine is not reachable
        now, or answers slower than ENGINE_LIST_TIMEOUT_S)."""
        if self.client is None or not self._status.available:
            return []
        client = self.client
        try:
            images = await asyncio.wait_for(self.engine(client.images.list), ENGINE_LIST_TIMEOUT_S)
        except (TimeoutError, CorralError, OSError):
            return []
        return [tag for image in images for tag in image.tags]

    async def ensure_available(self) -> None:
        if not self._status.available:
            # The engine may have come up since the daemon started: look again before refusing.
            self._status = await asyncio.get_running_loop().run_in_executor(self._pool, self.probe)
        if self._status.available:
            await self._open_pool(reap=False)  # (once; the pool's leftovers wait for the next start)
        if not self._status.available:
            if self._unreachable:
                raise Unavailable(f"the docker backend cannot make sandboxes now: {self._status.detail}")
            raise FailedPrecondition(f"the docker backend cannot make sandboxes here: {self._status.detail}")

    async def engine(self, fn, *args, **kwargs):
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

    async def check_image(self, image: str) -> None:
        docker = _docker()
        if not image or image == "host":
            raise InvalidArgument('the docker backend needs an image name (e.g. "debian:bookworm")')
        try:
            await self.engine(self.engine_client.images.get, image)
            return
        except NotFound:
            if not self.settings.pull:
                raise NotFound(
                    f"image {image!r} is not present on this node's Docker engine; build or load it "
                    "(docker build / docker load), or set docker.pull = true to pull from a registry"
                ) from None
        try:
            await self.engine(self.engine_client.images.pull, image)
        except (NotFound, FailedPrecondition, docker.errors.DockerException) as err:
            raise NotFound(f"image {image!r} could not be pulled: {err}") from err

    def _forkable(self, sandbox: SandboxRuntime) -> DockerSandbox:
        if not isinstance(sandbox, DockerSandbox) or sandbox.subvolume is None or sandbox.container is None:
            raise CannotFork(
                "forking docker sandboxes needs their writable layer on the btrfs pool, which this node does not "
                f'use ({self.engine_storage}; docs/backends.md, "Disk and fork on Docker and Podman")'
            )
        return sandbox

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        parent = self._forkable(sandbox)
        assert self.pool is not None  # (a subvolume is made only with the pool)
        return await parent.fork_point(self.pool.forks / f"{parent.spec.sandbox_id}-{secrets.token_hex(4)}")

    async def keep_snapshot(self, sandbox: SandboxRuntime, name: str) -> tuple[ForkPoint, int]:
        parent = self._forkable(sandbox)
        assert self.pool is not None
        point = await parent.fork_point(self.pool.snapshots / name)
        return point, await asyncio.to_thread(self.snapshot_store.admit, Path(point.path), parent.spec.sandbox_id)

    async def drop_fork_point(self, point: ForkPoint) -> None:
        await asyncio.to_thread(self.snapshot_store.drop, Path(point.path))

    async def remove_container(self, container: Container, layer_dir: Path | None) -> None:
        """Removes a container; one whose writable layer is the sandbox's (engine_layer.py) is
        stopped first (the engine unmounts its root), then the layer is taken away from the
        engine's directory, which the engine deletes."""
        if layer_dir is not None:
            with contextlib.suppress(NotFound):
                await self.engine(container.stop, timeout=0)
            await asyncio.to_thread(engine_layer.take_away, layer_dir)
        await self.engine(container.remove, force=True)

    async def release(self, record: dict) -> None:
        await self._remove_containers({LABEL_SANDBOX: record.get("sandbox_id", "")})
        await asyncio.to_thread(release_staging, self.context.state_dir, self.name, record)

    async def reap_orphans(self) -> None:
        if self._status.available:
            await self._remove_containers({})
        await asyncio.to_thread(unstage_all, staging_root(self.context.state_dir, self.name))
        if self._status.available and self.pool is not None and self.pool.used_before():
            await self._open_pool(reap=True)

    async def _open_pool(self, *, reap: bool) -> None:
        """Mounts the btrfs pool (docker.storage = "btrfs" or "auto") when the first sandbox needs
        it, or at the daemon's start where an earlier run used it: a daemon that makes no
        container holds no pool (no loop device, no mount). `reap`: deletes what an earlier daemon
        run left in it, only at the start (the pool is the local backend's too, whose sandboxes
        may live there by the time the engine answers). A pool that cannot be opened makes the
        backend unavailable, saying why ("auto": keeps the engine's layers instead)."""
        if self.pool is None or self._pool_open:
            return
        async with self._pool_opening:
            if self._pool_open:
                return
            try:
                await asyncio.to_thread(self.pool.open)
                self._pool_open = True
                if reap:
                    await asyncio.to_thread(self.pool.reap)
            except OSError as err:
                if self.settings.storage == "auto":
                    if self._pool_open:  # (mounted, but what an earlier run left cannot be deleted)
                        self._pool_open = False
                        await asyncio.to_thread(self.pool.close)
                    self._use_engine_storage(f"its pool cannot be used: {err.strerror or err}")
                    limits = {**self._status.limits, "disk": _disk_not_capped(self._driver, self.engine_storage)}
                    self._status = replace(self._status, limits=limits)
                    return
                log.error("the docker backend cannot make sandboxes: %s", err)
                self._status = replace(
                    self._status, available=False, detail=f'docker.storage = "btrfs": {err.strerror or err}'
                )

    async def _remove_containers(self, labels: dict[str, str]) -> None:
        if self.client is None:
            return
        filters = {"label": [f"{LABEL_DAEMON}={self.context.daemon_id}", *(f"{k}={v}" for k, v in labels.items())]}
        for container in await self.engine(self.client.containers.list, all=True, filters=filters):
            log.info("removing leftover container %s", container.name)
            # Its layer is taken away first if a daemon placed one there (whatever the storage
            # setting now: it may have changed since the crash); elsewhere that finds nothing.
            layer_dir = None
            with contextlib.suppress(FailedPrecondition):  # (a driver with no such directory)
                layer_dir = engine_layer.layer_dir(container.attrs)
            try:
                await self.remove_container(container, layer_dir)
            except (NotFound, FailedPrecondition):
                pass

    async def close(self) -> None:
        if self.pool is not None and self._pool_open:
            self._pool_open = False
            await asyncio.to_thread(self.pool.close)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.client is not None:
            self.client.close()
