"""Forks and snapshots of a rootless sandbox (no btrfs pool: it needs root to mount): copies of
its root's writable layer, workspace and /tmp, with reflinks where the state directory's
filesystem has them (btrfs, XFS: nearly free), else whole copies, bounded by the disk's free
space (docs/local-backend.md, "Without root").

Every copy runs in a user namespace where the daemon's uid is root, whose capabilities pass
directories the sandbox made unreadable (its own, so the daemon's uid's) and make the whiteouts of
the overlay's writable layer (character devices 0/0): the sandbox's own, to copy from it (only
there may a process reach the mount namespace its setup step made, through /proc/<pid>/root: its
processes are not dumpable for any other), else a new one (`unshare -r`).
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ... import diskcap


def in_sandbox_userns(nsenter: str, init_pid: int) -> list[str]:
    """The prefix that runs a command in the user namespace of the sandbox whose init is `init_pid`
    (the daemon's uid is root there; nothing else of the sandbox's is joined)."""
    return [nsenter, f"--user=/proc/{init_pid}/ns/user", "--preserve-credentials", "--"]


def in_own_userns(unshare: str) -> list[str]:
    """The prefix that runs a command in a new user namespace where the daemon's uid is root."""
    return [unshare, "--user", "--map-root-user", "--"]


def copy_writable(in_userns: list[str], src: Path, dest: Path, subs: Sequence[str]) -> None:
    """Copies the directories `subs` of sandbox directory `src` (a path a process run under
    `in_userns` can reach) to the same places in `dest`, merged into what is there, each without
    what is mounted inside it (the overlays on a "host" root's directories). A DiskCapError
    (ENOSPC where the disk filled) when it fails."""
    for sub in subs:
        if not (src / sub).is_dir():
            continue
        (dest / sub).mkdir(parents=True, exist_ok=True)
        diskcap.run_step(
            [*in_userns, "cp", "-a", "-x", "--reflink=auto", "--", f"{src / sub}/.", str(dest / sub)],
            "copy",
            f"the sandbox's {sub}",
            timeout=3600,
        )


def check_room(size_bytes: int, directory: Path) -> None:
    """ENOSPC (RESOURCE_EXHAUSTED) when a whole copy of `size_bytes` would not fit on the disk of
    `directory` (made if missing)."""
    directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if size_bytes > free:
        raise diskcap.DiskCapError(
            errno.ENOSPC,
            f"a copy of the sandbox's {size_bytes} bytes does not fit in the {free} bytes free on the "
            f"state directory's disk (no reflinks there)",
        )


def has_reflinks(directory: Path) -> bool:
    """Whether the filesystem of `directory` (made if missing) shares a copy's extents (FICLONE,
    `cp --reflink=always`), tried on a small file."""
    directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="reflink-probe-", dir=directory) as scratch:
        src = Path(scratch) / "a"
        src.write_bytes(b"x" * 4096)
        done = subprocess.run(["cp", "--reflink=always", str(src), f"{scratch}/b"], capture_output=True, timeout=30)
        return done.returncode == 0
