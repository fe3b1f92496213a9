"""What a node has room for: its resources, detected from /proc and the daemon's own cgroup, and
what its live sandboxes' limits commit of them (GetNodeInfo's NodeCapacity)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from corral.sdk.types import NodeCapacity

from .admission import counted_bytes, node_memory_bytes
from .backends.base import Limits

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class NodeResources:
    """What the daemon may hand to sandboxes, as detected at its start."""

    memory_bytes: int  # the smaller of MemTotal and the daemon's cgroup memory limit
    cpu_millicores: int  # its CPU affinity, capped by its cgroup's CPU quota


def detect_resources(proc: Path = Path("/proc"), cgroup_root: Path = CGROUP_ROOT) -> NodeResources:
    memory = node_memory_bytes(str(proc / "meminfo"))
    cpus = len(os.sched_getaffinity(0)) * 1000
    for controller, path in _own_cgroups(proc / "self" / "cgroup"):
        if controller in ("", "memory"):  # v2's single hierarchy, or v1's memory controller
            limit = _cgroup_memory_limit(cgroup_root, controller, path)
            if limit:
                memory = min(memory, limit)
        if controller in ("", "cpu", "cpu,cpuacct"):
            quota = _cgroup_cpu_quota(cgroup_root, controller, path)
            if quota:
                cpus = min(cpus, quota)
    return NodeResources(memory, cpus)


def _own_cgroups(path: Path) -> list[tuple[str, str]]:
    """(controllers, path) of each hierarchy /proc/self/cgroup names ("" for cgroup v2's)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            found.append((parts[1], parts[2]))
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _walk_up(cgroup_root: Path, mount: str, path: str) -> list[Path]:
    """The daemon's cgroup directory and its ancestors up to the hierarchy's root: a limit on any
    of them bounds the daemon."""
    base = cgroup_root / mount if mount else cgroup_root
    parts = [p for p in path.split("/") if p and p != ".."]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _cgroup_memory_limit(cgroup_root: Path, controller: str, path: str) -> int:
    """The tightest memory limit over the daemon's cgroup and its ancestors; 0: none."""
    mount, name = ("", "memory.max") if controller == "" else ("memory", "memory.limit_in_bytes")
    limits = []
    for directory in _walk_up(cgroup_root, mount, path):
        value = _read(directory / name)
        # v1 says "no limit" with a huge number (PAGE_COUNTER_MAX pages); beyond 2^60 is none.
        if value.isdigit() and int(value) < 1 << 60:
            limits.append(int(value))
    return min(limits, default=0)


def _cgroup_cpu_quota(cgroup_root: Path, controller: str, path: str) -> int:
    """The tightest CPU quota in millicores over the daemon's cgroup and its ancestors; 0: none."""
    quotas = []
    for directory in _walk_up(cgroup_root, "" if controller == "" else controller, path):
        if controller == "":
            quota, _, period = _read(directory / "cpu.max").partition(" ")
        else:
            quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
        if quota.isdigit() and period.isdigit() and int(period):
            quotas.append(max(1, int(quota) * 1000 // int(period)))
    return min(quotas, default=0)


def disk_free_bytes(path: Path) -> int:
    """Free space of the filesystem holding `path` (0 where it cannot be read)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def node_capacity(
    *,
    live: Iterable[tuple[str, Limits]],
    max_sandboxes: int,
    default_memory_bytes: int,
    resources: NodeResources,
    node_memory: int,
    overcommit: float,
    disk_free: int,
    images: Iterable[str],
) -> NodeCapacity:
    """NodeCapacity of the live sandboxes (state, limits); starting ones count as live."""
    running = starting = 0
    memory = cpu = disk = 0
    for state, limits in live:
        if state == "starting":
            starting += 1
        else:
            running += 1
        memory += counted_bytes(limits.memory_bytes, node_memory)
        cpu += limits.cpu_millicores
        disk += limits.disk_bytes
    free_slots = max(0, max_sandboxes - running - starting)
    admitted = int(overcommit * node_memory)
    by_memory = free_slots
    if admitted:
        by_memory = max(0, admitted - memory) // counted_bytes(default_memory_bytes, node_memory)
    return NodeCapacity(
        max_sandboxes=max_sandboxes,
        running=running,
        starting=starting,
        free_slots=free_slots,
        free_slots_default_limits=min(free_slots, by_memory),
        memory_committed_bytes=memory,
        memory_available_bytes=resources.memory_bytes,
        memory_admitted_bytes=admitted,
        cpu_committed_millicores=cpu,
        cpu_available_millicores=resources.cpu_millicores,
        disk_committed_bytes=disk,
        disk_available_bytes=disk_free,
        images_cached=tuple(sorted(images)),
    )
