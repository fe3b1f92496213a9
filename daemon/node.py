"""What this node offers: its backends, built from the registry, and `Node`, the node-level calls
(GetNodeInfo: what the node runs, holds and has room for; Drain: taking it out of service and
back)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Protocol

from corral.sdk.types import NodeCapacity, PoolInfo

from .backends.base import Backend, BackendContext, BackendStatus, run_dir_base
from .backends.registry import BACKENDS
from .capacity import detect_resources, disk_free_bytes, node_capacity
from .cgroups import CgroupDriver
from .config import Config
from .sandboxes import SandboxManager
from .uids import UidPool

log = logging.getLogger(__name__)


def version() -> str:
    try:
        return metadata.version("corral")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def make_backends(
    config: Config,
    cgroups: CgroupDriver,
    daemon_id: str,
    *,
    hidden_paths: Sequence[str] = (),
    backend_classes: Mapping[str, type[Backend]] | None = None,
) -> dict[str, Backend]:
    """Every registered backend (or those of `backend_classes`, by name: tests put a stand-in in
    place of one), each with its own settings and the shared rest of the context (one uid pool for
    all of them: a uid is never handed to two sandboxes)."""
    uids = UidPool(config.sandbox.uid_base, config.sandbox.uid_count)
    run_base = run_dir_base(daemon_id)
    return {
        name: backend_class(
            BackendContext(
                name=name,
                daemon_id=daemon_id,
                state_dir=config.state_path,
                run_base=run_base,
                cgroups=cgroups,
                uids=uids,
                workdir=config.sandbox.workdir,
                max_file_bytes=config.exec.max_file_bytes,
                hidden_paths=tuple(hidden_paths),
                settings=config.backend(name),
            )
        )
        for name, backend_class in (BACKENDS if backend_classes is None else backend_classes).items()
    }


@dataclass(frozen=True)
class NodeInfo:
    version: str
    daemon_id: str
    default_backend: str
    backends: dict[str, BackendStatus]
    cgroup_mode: str
    sandbox_count: int
    pools: Sequence[PoolInfo] = ()
    capacity: NodeCapacity = NodeCapacity()
    draining: bool = False
    empty: bool = False
    rootless: bool = False  # the daemon is not root (an ordinary user's)


class LiveRollouts(Protocol):
    """What the node needs to know of the rollout pipeline: its rollouts not finished yet."""

    @property
    def live_count(self) -> int: ...


class Node:
    """The node as a whole: its description and capacity (info), whether anything is left on it
    (empty), and draining (drain). Its resources are detected once, when it is made."""

    def __init__(
        self,
        config: Config,
        daemon_id: str,
        backends: Mapping[str, Backend],
        cgroups: CgroupDriver,
        sandboxes: SandboxManager,
        rollouts: LiveRollouts,
    ) -> None:
        self.config = config
        self.daemon_id = daemon_id
        self.backends = backends
        self.cgroups = cgroups
        self.sandboxes = sandboxes
        self.rollouts = rollouts
        self.resources = detect_resources()

    async def info(self) -> NodeInfo:
        images = await asyncio.gather(*(backend.cached_images() for backend in self.backends.values()))
        config = self.config
        capacity = node_capacity(
            live=[(sb.state, sb.limits) for sb in self.sandboxes.list()],
            max_sandboxes=config.daemon.max_sandboxes,
            default_memory_bytes=config.limits.memory_bytes,
            resources=self.resources,
            node_memory=self.sandboxes.node_memory_bytes,
            overcommit=config.daemon.memory_overcommit,
            disk_free=await asyncio.to_thread(disk_free_bytes, config.state_path),
            images=[f"{name}:{image}" for name, held in zip(self.backends, images, strict=True) for image in held],
        )
        return NodeInfo(
            version=version(),
            daemon_id=self.daemon_id,
            default_backend=config.daemon.default_backend,
            backends={name: b.status() for name, b in self.backends.items()},
            cgroup_mode=self.cgroups.mode,
            sandbox_count=len(self.sandboxes),
            pools=self.sandboxes.pools.status(),
            capacity=capacity,
            draining=self.sandboxes.draining,
            empty=self.empty(),
            rootless=os.geteuid() != 0,
        )

    def empty(self) -> bool:
        """Nothing left on the node: no sandbox, live or starting, and no rollout unfinished."""
        return not len(self.sandboxes) and not self.rollouts.live_count

    async def drain(self, draining: bool) -> tuple[bool, bool]:
        """Drains the node (no new sandboxes or rollouts; SandboxManager.set_draining) or takes it
        back into service; (draining, empty)."""
        await self.sandboxes.set_draining(draining)
        log.info(
            "%s", "draining: no new sandboxes or rollouts" if draining else "taking new sandboxes and rollouts again"
        )
        return self.sandboxes.draining, self.empty()
