"""Admission of new sandboxes against the node's memory (daemon.memory_overcommit).

The memory limits of the sandboxes on a node may add up to the overcommit factor times its
physical memory: past that, CreateSandbox is refused with RESOURCE_EXHAUSTED before anything is
made, instead of admitting sandboxes that the kernel's OOM killer would later have to choose
between. A sandbox without a memory limit counts as the whole node.
"""

from __future__ import annotations

from collections.abc import Iterable

from corral.sdk.errors import ResourceExhausted

GIB = 1 << 30


def node_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The node's physical memory (MemTotal)."""
    with open(meminfo) as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key == "MemTotal":
                return int(rest.split()[0]) * 1024
    raise OSError(f"no MemTotal in {meminfo}")


def counted_bytes(memory_limit: int, node_bytes: int) -> int:
    """What one sandbox counts against the node: its limit, or all of the node without one."""
    return memory_limit or node_bytes


def admit_memory(held_limits: Iterable[int], wanted: int, node_bytes: int, overcommit: float) -> None:
    """Raises ResourceExhausted when a sandbox with the memory limit `wanted` (0: none) would take
    the sum of the limits `held_limits` of the node's sandboxes past `overcommit` x `node_bytes`.
    An overcommit of 0 admits everything."""
    if not overcommit:
        return
    capacity = int(overcommit * node_bytes)
    held = sum(counted_bytes(limit, node_bytes) for limit in held_limits)
    asked = counted_bytes(wanted, node_bytes)
    if held + asked > capacity:
        raise ResourceExhausted(
            f"not enough memory on this node for a sandbox with a {_gib(asked)} memory limit: its "
            f"sandboxes' limits already add up to {_gib(held)} of the {_gib(capacity)} admitted "
            f"(daemon.memory_overcommit {overcommit:g} x {_gib(node_bytes)} of memory); destroy "
            "sandboxes, ask for a smaller limits.memory_bytes, or use another node"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
