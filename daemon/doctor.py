"""`corral doctor`: what this machine can do, found the same way the daemon finds it at start."""

from __future__ import annotations

import os

from .backends.base import run_dir_base
from .backends.base import BackendStatus
from .backends.docker import DockerBackend
from .backends.local import LocalBackend
from .backends.singularity import SingularityBackend
from .uids import UidPool
from .cgroups import CgroupDriver
from .config import Config


def probe(config: Config) -> tuple[str, dict[str, BackendStatus]]:
    """(cgroup mode, status per backend) without creating anything."""
    cgroups = CgroupDriver("doctor", create=False)
    uids = UidPool(config.local.uid_base, config.local.uid_count)
    run_base = run_dir_base("doctor")
    local = LocalBackend(config, cgroups, hidden_paths=[], run_base=run_base, uids=uids)
    docker = DockerBackend(config, cgroups, "doctor", run_base, uids)
    singularity = SingularityBackend(config, cgroups, "doctor", run_base, uids)
    return cgroups.mode, {"local": local.status(), "docker": docker.status(), "singularity": singularity.status()}


def report(config: Config) -> str:
    mode, backends = probe(config)
    lines = [f"cgroups: {mode}" + ("" if os.geteuid() == 0 else " (not root: cgroups and per-sandbox uids unavailable)")]
    for name, status in backends.items():
        lines.append(f"{name}: {'available' if status.available else 'unavailable'} - {status.detail}")
        if status.available:
            lines.append(f"  isolation: {status.isolation}")
        for kind, limit in status.limits.items():
            state = f"enforced ({limit.mechanism})" if limit.enforced else f"not enforced: {limit.reason}"
            lines.append(f"  {kind}: {state}")
    return "\n".join(lines)
