"""A size cap on a sandbox's writable space: a filesystem of its own, mounted by the daemon over the
sandbox's host directory (the parent of `workspace/` and `tmp/`), so that writing past the cap fails
with ENOSPC inside the sandbox and nothing outside it fills up.

Two kinds, chosen once at start (`probe`):

- "loop ext4": a sparse image file formatted ext4 (no journal: the filesystem never outlives the
  sandbox) and loop-mounted with `discard`, so that deleting files inside gives the space back to
  the host. The image is unlinked as soon as it is mounted: the loop device holds it, and unmounting
  (the loop device is auto-cleared) frees it, so a crashed daemon leaves no image file, only a
  mount that the next start's reap unmounts. Disk for disk, but images are sparse: the caps of all
  sandboxes together may exceed the free space of the state directory's disk.
- "tmpfs", where the node has no loop devices or mkfs.ext4 (e.g. inside an unprivileged
  container): a size-capped tmpfs. Its pages are memory, charged to the memory cgroup of the process
  that writes them: what a sandbox keeps on disk counts against its memory limit.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from .cgroups import LimitSupport

LOOP_EXT4 = "loop ext4"
TMPFS = "tmpfs"
_MNT_DETACH = 2
# No reserved blocks (the sandbox's uid gets the whole cap), no journal and no room to grow (the
# filesystem never outlives its sandbox nor changes size: a 4 GiB image starts at about 170 KiB of
# metadata instead of 2 MiB), inode tables left for the kernel to initialise.
_MKFS_ARGS = ("-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode", "-E", "lazy_itable_init=1,nodiscard")
_libc = ctypes.CDLL(None, use_errno=True)


class DiskCapError(OSError):
    """The capped filesystem could not be made: ENOSPC where the state directory's disk is full
    (the node is out of space, as for any other file of the sandbox), else EIO; the message says
    which step failed."""


@lru_cache
def probe(scratch: Path) -> tuple[str, LimitSupport]:
    """The kind this node supports and how it is reported: loop ext4 where a small image really
    mounts under `scratch` (a directory on the state directory's disk), else tmpfs (root only).
    Once per directory: every backend of the daemon shares the answer."""
    if os.geteuid() != 0:
        return "", LimitSupport(False, reason="the daemon is not root: it cannot mount a filesystem per sandbox")
    why_not_loop = "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    if shutil.which("mkfs.ext4"):
        scratch.mkdir(parents=True, exist_ok=True)
        target = Path(tempfile.mkdtemp(prefix="disk-probe-", dir=scratch))
        try:
            _mount_loop(target, 16 << 20)
            unmount(target)
            return LOOP_EXT4, LimitSupport(True, "per-sandbox loop-mounted ext4 image (sparse)")
        except OSError as err:
            why_not_loop = f"no loop-mounted image ({err})"
        finally:
            shutil.rmtree(target, ignore_errors=True)
    return TMPFS, LimitSupport(
        True, f"per-sandbox size-capped tmpfs, counted against the sandbox's memory ({why_not_loop})"
    )


async def mount_capped(kind: str, target: Path, size_bytes: int) -> None:
    """Mounts a fresh filesystem of `size_bytes` at the (empty) directory `target`."""
    await asyncio.to_thread(_mount_loop if kind == LOOP_EXT4 else _mount_tmpfs, target, size_bytes)


def _mount_loop(target: Path, size_bytes: int) -> None:
    # The image lies in `target` itself, under the mount once it is made, so that whatever a crash
    # cuts short is removed with the sandbox's directory; the directory opened beforehand still
    # reaches it, to unlink it once the loop device holds it.
    image = target / ".disk.img"
    under = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(image, "wb") as fh:
            fh.truncate(size_bytes)
        run_step(["mkfs.ext4", *_MKFS_ARGS, str(image)], "format")
        run_step(["mount", "-o", "loop,nosuid,nodev,discard", str(image), str(target)], "mount")
    finally:
        try:
            os.unlink(image.name, dir_fd=under)
        except FileNotFoundError:
            pass
        os.close(under)
    (target / "lost+found").rmdir()


def _mount_tmpfs(target: Path, size_bytes: int) -> None:
    run_step(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0711,nosuid,nodev", "corral-disk", str(target)], "mount"
    )


def run_step(argv: list[str], step: str, what: str = "the sandbox's filesystem", timeout: float = 60) -> str:
    """Runs one tool that makes a filesystem (mkfs, mount) and returns what it printed: a
    DiskCapError saying which step failed and why (ENOSPC where the tool says the disk is full)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as err:
        raise DiskCapError(errno.EIO, f"cannot {step} {what}: {err}") from err
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        code = errno.ENOSPC if os.strerror(errno.ENOSPC) in said else errno.EIO
        raise DiskCapError(code, f"cannot {step} {what}: {said}")
    return done.stdout.strip()


def disk_usage(path: Path) -> int:
    """The bytes a directory tree takes on disk, each hard-linked file once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for parent, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(parent, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def unmount(target: Path) -> None:
    """Detaches whatever is mounted at `target` (a loop mount frees its image); nothing when
    nothing is. Lazy, so that a process still holding a file there cannot keep it busy."""
    if os.path.ismount(target):
        if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot unmount the sandbox's filesystem: {os.strerror(err)}", str(target))
