"""What this node offers: backends, isolation, enforced limits. Used by GetNodeInfo and doctor."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from .backends.base import BackendStatus


def version() -> str:
    try:
        return metadata.version("corral")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class NodeInfo:
    version: str
    daemon_id: str
    default_backend: str
    backends: dict[str, BackendStatus]
    cgroup_mode: str
    sandbox_count: int
