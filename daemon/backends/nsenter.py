"""Entering a live sandbox's namespaces from the host with util-linux nsenter.

Used by every backend whose sandboxes are namespaces of a process on this host (bubblewrap and
unshare sandboxes, Docker containers, Apptainer instances): a few milliseconds, against ~100 ms
for `docker exec`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def nsenter_argv(nsenter: str, target_pid: int, uid: int, workdir: str, argv: Sequence[str], cwd: str) -> list[str]:
    """Runs argv as `uid` in the mount, pid, ipc, uts and net namespaces and the root of
    `target_pid`, starting in `cwd` (default: the target's own cwd, which is `workdir`)."""
    enter = [
        nsenter, "-t", str(target_pid), "-m", "-p", "-i", "-u", "-n",
        "-r", "-w", "-S", str(uid), "-G", str(uid), "--",
    ]
    if cwd and os.path.normpath(cwd) != workdir:
        # nsenter can only take the target's cwd; change directory once inside.
        enter += ["/bin/sh", "-c", 'cd -- "$1" || exit 126; shift; exec "$@"', "sh", cwd]
    return [*enter, *argv]
