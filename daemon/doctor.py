"""`corral doctor`: what this machine can do, found the same way the daemon finds it at start."""

from __future__ import annotations

import os

from .backends.base import BackendStatus
from .cgroups import CgroupDriver
from .config import Config
from .node import make_backends


def probe(config: Config) -> tuple[str, dict[str, BackendStatus]]:
    """(cgroup mode, status per backend) without creating anything."""
    cgroups = CgroupDriver("doctor", create=False)
    backends = make_backends(config, cgroups, "doctor")
    return cgroups.mode, {name: backend.status() for name, backend in backends.items()}


def report(config: Config) -> str:
    mode, backends = probe(config)
    lines = [
        f"cgroups: {mode}" + ("" if os.geteuid() == 0 else " (not root: cgroups and per-sandbox uids unavailable)")
    ]
    for name, status in backends.items():
        lines.append(f"{name}: {'available' if status.available else 'unavailable'} - {status.detail}")
        if status.available:
            lines.append(f"  isolation: {status.isolation}")
        for kind, limit in status.limits.items():
            state = f"enforced ({limit.mechanism})" if limit.enforced else f"not enforced: {limit.reason}"
            lines.append(f"  {kind}: {state}")
    return "\n".join(lines)
