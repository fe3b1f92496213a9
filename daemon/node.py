"""What this node offers: its backends, built from the registry, and a summary of them for
GetNodeInfo and `corral doctor`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata

from corral.sdk.types import NodeCapacity, PoolInfo

from .backends.base import Backend, BackendContext, BackendStatus, run_dir_base
from .backends.registry import BACKENDS
from .cgroups import CgroupDriver
from .config import Config
from .uids import UidPool


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
