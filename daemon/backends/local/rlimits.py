"""Limits of a rootless sandbox that no cgroup holds: rlimits in their place, each reported as
approximated with what it misses (docs/local-backend.md, "Without root").

A daemon without root has cgroups only where its user was delegated a subtree (cgroups.py finds
one by trying); for each of memory, pids and disk that none holds, every process of the sandbox
gets an rlimit standing in for it: its init (set by the root setup step, after the sandbox's user
namespace exists) and every command, shell and kernel that enters (a `prlimit` prefix). Each is
set soft and hard alike: raising a hard limit takes CAP_SYS_RESOURCE in the host's user
namespace, which root inside lacks.

- memory: RLIMIT_AS, the address space of each process: virtual memory (what a program reserves,
  not what it uses), each process on its own, not the sandbox's sum.
- pids: RLIMIT_NPROC. Linux counts it per user and per user namespace (since 5.14, when it moved
  to ucounts), and every rootless sandbox has a user namespace of its own, so the count is the
  sandbox's processes and threads alone, as pids.max counts them. Before 5.14 it counted every
  process of the daemon's uid on the host (the daemon, every sandbox, the user's login), which
  would fail sandboxes for what others run: there it is left out.
- disk, where the cap is watched (diskwatch.py; a capped tmpfs needs no rlimit): RLIMIT_FSIZE,
  the size of each file written: no single file past the cap between two of the watcher's sums. A write past it sends the writer SIGXFSZ, which kills it ("File size limit
  exceeded", as under `ulimit -f`), and fails with EFBIG ("File too large") in a program that
  ignores the signal (Python does). Sandbox programs get the signal's default as any program does
  (seccomp.py's loader resets it), so it is not ignored for them here either.
- cpu: no rlimit stands for a rate (RLIMIT_CPU counts seconds of CPU time, and kills at the
  end): absent.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ...cgroups import LimitSupport

# The first kernel that counts RLIMIT_NPROC per user namespace (ucounts).
NPROC_PER_NAMESPACE = (5, 14)


@dataclass(frozen=True)
class StandIn:
    """The rlimit that stands for one kind of limit."""

    resource: str  # prlimit's option and the RLIMIT_ name, lower case: as, nproc, fsize
    support: LimitSupport


STAND_INS = {
    "memory": StandIn(
        "as",
        LimitSupport(False, "RLIMIT_AS per process: counts virtual memory, not the sandbox's sum", approximated=True),
    ),
    "pids": StandIn(
        "nproc",
        LimitSupport(
            False,
            "RLIMIT_NPROC, counted per sandbox (its own user namespace): processes and threads",
            approximated=True,
        ),
    ),
    "disk": StandIn(
        "fsize",
        LimitSupport(
            False,
            "RLIMIT_FSIZE: no single file past the cap (SIGXFSZ, EFBIG), all files together uncapped",
            approximated=True,
        ),
    ),
}
CPU_ABSENT = "no rlimit caps a CPU rate (RLIMIT_CPU counts CPU seconds)"


def kernel_counts_nproc_per_namespace(release: str | None = None) -> bool:
    """Whether this kernel (its release string, e.g. "6.1.0-18-amd64") counts RLIMIT_NPROC per
    user namespace."""
    found = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    return bool(found) and (int(found[1]), int(found[2])) >= NPROC_PER_NAMESPACE  # type: ignore[index]


class SandboxRlimits:
    """Which rlimits a rootless backend gives its sandboxes: decided once, from the limits its
    cgroups hold (`held`: the kinds they enforce) and what this host has."""

    def __init__(self, held: set[str], prlimit: str | None = None, release: str | None = None) -> None:
        """`prlimit`: its path (None: looked up; "": none); `release`: the kernel's (None: this one)."""
        self.prlimit = prlimit if prlimit is not None else shutil.which("prlimit")
        self.absent: dict[str, str] = {}  # kind -> why no rlimit stands for it
        self.stand_ins = {kind: s for kind, s in STAND_INS.items() if kind not in held}
        if not self.prlimit:
            for kind in self.stand_ins:
                self.absent[kind] = "util-linux prlimit is not installed (apt-get install util-linux)"
            self.stand_ins = {}
        elif "pids" in self.stand_ins and not kernel_counts_nproc_per_namespace(release):
            del self.stand_ins["pids"]
            self.absent["pids"] = (
                "RLIMIT_NPROC counts every process of the daemon's uid before Linux 5.14, so it is not set"
            )

    def report(self, limits: dict[str, LimitSupport]) -> dict[str, LimitSupport]:
        """`limits` (the backend's, the cgroups' view) with each kind the cgroups do not enforce
        said as approximated by its rlimit, or absent with both reasons."""
        reported = dict(limits)
        for kind, stand_in in self.stand_ins.items():
            reported[kind] = replace(stand_in.support, reason=limits[kind].reason)
        for kind, why in self.absent.items():
            reported[kind] = LimitSupport(False, reason=f"{limits[kind].reason}; {why}")
        if "cpu" in reported and not reported["cpu"].enforced:
            reported["cpu"] = LimitSupport(False, reason=f"{reported['cpu'].reason}; {CPU_ABSENT}")
        return reported

    def values(self, memory_bytes: int, pids: int, disk_bytes: int) -> dict[str, int]:
        """The rlimits of one sandbox with these limits (0: none), by resource."""
        wanted = {"memory": memory_bytes, "pids": pids, "disk": disk_bytes}
        return {s.resource: _within_own(s.resource, wanted[kind]) for kind, s in self.stand_ins.items() if wanted[kind]}

    def prefix(self, values: Mapping[str, int]) -> list[str]:
        """The command prefix that runs what follows under `values` (empty: none to set)."""
        if not values:
            return []
        assert self.prlimit  # (no stand-ins, so no values, without it)
        return [self.prlimit, *(f"--{name}={value}" for name, value in sorted(values.items())), "--"]


def _within_own(resource_name: str, value: int) -> int:
    """`value`, or the daemon's own hard limit where that is lower: an ordinary user cannot raise
    a hard limit, and a sandbox never gets more than its daemon has anyway."""
    _, hard = resource.getrlimit(getattr(resource, f"RLIMIT_{resource_name.upper()}"))
    return value if hard == resource.RLIM_INFINITY else min(value, hard)
