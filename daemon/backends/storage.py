"""Copy-on-write storage for sandboxes (`local.storage = "btrfs"`, `docker.storage = "btrfs"`): the
writable space of every sandbox (everything its sandbox directory holds: for a local sandbox its
workspace, /tmp and its root's overlay upper and work directories; for a container its workspace
and the engine's writable layer, engine_layer.py) is a btrfs subvolume, so that one quota caps
all of it and a sandbox can be forked in O(1).

- **The pool**: one btrfs filesystem per node, `<state_dir>/storage`, the state directory's own
  when that is btrfs, else a sparse image file (`<state_dir>/storage.img`) formatted btrfs and
  loop-mounted there (by the local backend at start, by the docker backend when its first
  container needs it), reused across restarts; every backend that keeps sandboxes in it
  shares the one object (`node_pool`). `sandboxes/` holds one subvolume per sandbox, `forks/` the
  read-only snapshots of parents at the moment of a fork. Nothing in it outlives a daemon run: a
  restart detaches every mount of it left outside the pool and deletes every subvolume (`reap`).
- **Disk caps**: btrfs quota groups, each subvolume limited to `limits.disk_bytes` of referenced
  data (what it holds, shared extents included: a child counts its parent's files as a full copy
  would). Writing past the cap fails with EDQUOT ("Disk quota exceeded"), not ENOSPC.
- **Ids**: each sandbox has its own block of host ids (daemon/uids.py), and its files on disk carry
  the ids of the block of the sandbox that first wrote the subvolume (its "disk id base"). A fork
  child is bound at its sandbox directory through an idmapped mount that shows the disk base's
  block as its own (and host root as host root), so nothing is chowned and no id is shared: what
  the child writes lands on disk under the original block, seen by no one else.

Subvolumes are made, snapshotted, limited and deleted with the btrfs ioctls (a snapshot costs
well under a millisecond); the pool is formatted and its quotas turned on with btrfs-progs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from ..diskcap import run_step
from . import snapshot_store
from .mount_api import (
    MOUNT_ATTR_IDMAP,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOSUID,
    attach_tree,
    detach,
    detached_tree,
    make_user_namespace,
)

log = logging.getLogger(__name__)

BTRFS_SUPER_MAGIC = 0x9123683E
_VOL_NAME_MAX = 4039  # BTRFS_SUBVOL_NAME_MAX
_SUBVOL_RDONLY = 1 << 1
_QGROUP_LIMIT_MAX_RFER = 1 << 0


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (0x94 << 8) | nr


def _ior(nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (0x94 << 8) | nr


class _VolArgs(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int64), ("name", ctypes.c_char * 4088)]


class _VolArgsV2(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_int64),
        ("transid", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 4),
        ("name", ctypes.c_char * 4040),
    ]


class _QgroupLimit(ctypes.Structure):
    _fields_ = [
        ("qgroupid", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("max_rfer", ctypes.c_uint64),
        ("max_excl", ctypes.c_uint64),
        ("rsv_rfer", ctypes.c_uint64),
        ("rsv_excl", ctypes.c_uint64),
    ]


_IOC_SUBVOL_CREATE = _iow(14, ctypes.sizeof(_VolArgs))
_IOC_SNAP_DESTROY = _iow(15, ctypes.sizeof(_VolArgs))
_IOC_SNAP_CREATE_V2 = _iow(23, ctypes.sizeof(_VolArgsV2))
_IOC_QGROUP_LIMIT = _ior(43, ctypes.sizeof(_QgroupLimit))


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_long * 15)]


_libc = ctypes.CDLL(None, use_errno=True)


def is_btrfs(path: Path) -> bool:
    buf = _StatFs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return buf.f_type & 0xFFFFFFFF == BTRFS_SUPER_MAGIC


def _ioctl_in_parent(path: Path, request: int, args: ctypes.Structure) -> None:
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, request, args)
    finally:
        os.close(fd)


def _name(path: Path) -> bytes:
    name = os.fsencode(path.name)
    if not name or len(name) > _VOL_NAME_MAX:
        raise OSError(errno.ENAMETOOLONG, "bad subvolume name", str(path))
    return name


def create_subvolume(path: Path) -> None:
    """An empty subvolume at `path` (its parent directory must be on btrfs)."""
    _ioctl_in_parent(path, _IOC_SUBVOL_CREATE, _VolArgs(0, _name(path)))


def snapshot(source: Path, path: Path, *, read_only: bool) -> None:
    """A snapshot of the subvolume `source` at `path`: O(1), sharing every extent."""
    src = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        args = _VolArgsV2(src, 0, _SUBVOL_RDONLY if read_only else 0)
        args.name = _name(path)
        _ioctl_in_parent(path, _IOC_SNAP_CREATE_V2, args)
    finally:
        os.close(src)


def delete_subvolume(path: Path) -> None:
    """Deletes a subvolume and all it holds (the space comes back in the background); nothing
    when there is none."""
    try:
        _ioctl_in_parent(path, _IOC_SNAP_DESTROY, _VolArgs(0, _name(path)))
    except FileNotFoundError:
        pass


def limit_subvolume(path: Path, size_bytes: int) -> None:
    """Caps what the subvolume may hold (referenced bytes) at `size_bytes` (0: no cap)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, _IOC_QGROUP_LIMIT, _QgroupLimit(0, _QGROUP_LIMIT_MAX_RFER, size_bytes or (1 << 64) - 1))
    finally:
        os.close(fd)


def syncfs(path: Path) -> None:
    """Writes out what the filesystem of `path` holds in memory, so a snapshot taken next has it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}", str(path))
    finally:
        os.close(fd)


def kernel_has_btrfs() -> bool:
    """Whether the kernel has btrfs now (/proc/filesystems) or can load it (its modules.dep)."""
    if any(line.split()[-1:] == ["btrfs"] for line in Path("/proc/filesystems").read_text().splitlines()):
        return True
    modules = Path("/lib/modules") / os.uname().release
    for listing in ("modules.dep", "modules.builtin"):
        with contextlib.suppress(OSError):
            if "/btrfs.ko" in (modules / listing).read_text():
                return True
    return False


def _on_btrfs(path: Path) -> bool:
    """Whether `path`, or the nearest directory above it that exists, is on btrfs."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return is_btrfs(path)


_NODE_POOLS: dict[Path, StoragePool] = {}


def node_pool(state_dir: Path, size_bytes: int) -> StoragePool:
    """The pool under `state_dir`, one object for every backend that keeps sandboxes in it (the
    first one's `size_bytes` sizes its image when it is made)."""
    pool = _NODE_POOLS.get(state_dir)
    if pool is None:
        pool = _NODE_POOLS[state_dir] = StoragePool(state_dir, size_bytes)
    return pool


class StoragePool:
    """The node's btrfs pool of sandbox subvolumes (see the module's docstring)."""

    def __init__(self, state_dir: Path, size_bytes: int) -> None:
        self.root = state_dir / "storage"
        self.image = state_dir / "storage.img"
        self.size_bytes = size_bytes
        self.sandboxes = self.root / "sandboxes"
        self.forks = self.root / "forks"
        self.snapshots = self.root / "snapshots"
        self._users = 0  # backends that opened it and have not closed it

    def lacking(self) -> str:
        """ "" when this node can have the pool, else what it lacks: btrfs-progs, a kernel with
        btrfs, and loop devices for the image (unless the state directory is btrfs itself)."""
        for tool in ("mkfs.btrfs", "btrfs"):
            if not shutil.which(tool):
                return f"{tool} is not installed (apt-get install btrfs-progs)"
        if not kernel_has_btrfs():
            return f"the kernel ({os.uname().release}) has no btrfs filesystem (built in or as a module)"
        if not _on_btrfs(self.root.parent) and not os.path.exists("/dev/loop-control"):
            return "no loop devices (/dev/loop-control) for the pool's image, and the state directory is not on btrfs"
        return ""

    def open(self) -> None:
        """Mounts the pool (formatting its image the first time) with quotas on; idempotent, and
        counted: it stays mounted until every backend that opened it closed it."""
        self._mount()
        self._users += 1

    def _mount(self) -> None:
        self.root.mkdir(mode=0o700, exist_ok=True)
        if not is_btrfs(self.root):
            if not self.image.exists():
                size = self.size_bytes or shutil.disk_usage(self.root.parent).total
                with open(self.image, "wb") as fh:
                    fh.truncate(size)
                _run(["mkfs.btrfs", "-q", "-f", "-m", "single", str(self.image)], "format")
            _run(["mount", "-o", "loop,nosuid,nodev,discard", str(self.image), str(self.root)], "mount")
        _run(["btrfs", "quota", "enable", str(self.root)], "turn quotas on in")
        for sub in (self.sandboxes, self.forks, self.snapshots):
            sub.mkdir(mode=0o700, exist_ok=True)

    def used_before(self) -> bool:
        """Whether an earlier daemon run may have left sandboxes in the pool: its image exists, or
        the pool is mounted (or the state directory's own btrfs)."""
        return self.image.exists() or (self.root.is_dir() and is_btrfs(self.root))

    def close(self) -> None:
        """Unmounts the pool's image (lazily) when its last backend closes it (the daemon stops);
        its next start mounts it again."""
        self._users = max(self._users - 1, 0)
        if not self._users and self.image.exists() and os.path.ismount(self.root):
            detach(self.root)

    def subvolume(self, sandbox_id: str) -> Path:
        return self.sandboxes / sandbox_id

    def reap(self) -> None:
        """Deletes every subvolume a previous daemon run left (no sandbox outlives its daemon),
        after detaching every mount of them it left outside the pool (sandbox directories, engine
        layer directories: engine_layer.py)."""
        for mount_point in self._mounts_outside():
            log.info("detaching leftover mount %s of the sandbox storage pool", mount_point)
            detach(mount_point)
        for base in (self.sandboxes, self.forks, self.snapshots):
            for leftover in base.iterdir() if base.is_dir() else ():
                try:
                    delete_subvolume(leftover)
                except OSError as err:
                    if err.errno not in (errno.ENOTTY, errno.EINVAL, errno.EPERM):
                        raise
                    shutil.rmtree(leftover, ignore_errors=True)  # a plain directory

    def _mounts_outside(self) -> list[str]:
        """Where this daemon's mount namespace has sandbox subvolumes of the pool mounted (the
        pool's device, as /proc/self/mountinfo names it, and a root under /sandboxes/), latest
        first: a mount on top of another goes first. Only where the pool is a filesystem of its
        own (its image): on a btrfs state directory the records name the mounts instead."""
        root = os.path.realpath(self.root)
        mounts = [(fields[2], _unescape(fields[3]), _unescape(fields[4])) for fields in _mountinfo()]
        devices = {device for device, within, point in mounts if point == root and within == "/"}
        return [
            point
            for device, within, point in reversed(mounts)
            if device in devices and within.startswith(f"/{self.sandboxes.name}/")
        ]


def _mountinfo() -> list[list[str]]:
    return [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def _unescape(field: str) -> str:
    """A path as /proc/self/mountinfo writes it (space, tab, newline, backslash: octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def make_subvolume(pool: StoragePool, sandbox_id: str, fork_path: str, disk_bytes: int) -> Path:
    """A sandbox's subvolume: a new one, or (`fork_path`) a writable snapshot of a fork point;
    capped at `disk_bytes` (a fork's is always set: a snapshot keeps its source's limit)."""
    subvolume = pool.subvolume(sandbox_id)
    if fork_path:
        snapshot(Path(fork_path), subvolume, read_only=False)
    else:
        create_subvolume(subvolume)
    try:
        if disk_bytes or fork_path:
            limit_subvolume(subvolume, disk_bytes)
    except BaseException:
        delete_subvolume(subvolume)
        raise
    return subvolume


def snapshot_paused(subvolume: Path, point: Path, pause: Callable[[bool], bool] | None = None) -> None:
    """Snapshots `subvolume` read-only at `point`, written out first so that the snapshot holds
    what the sandbox wrote. `pause`: pauses the sandbox around it (`pause(True)`, False when it
    cannot, e.g. no cgroup v2 freezer) and resumes it (`pause(False)`); None: the caller did."""
    paused = pause(True) if pause else False
    try:
        syncfs(subvolume)
        snapshot(subvolume, point, read_only=True)
    finally:
        if paused:
            pause(False)  # type: ignore[misc]


class SnapshotStore(snapshot_store.SnapshotStore):
    """The named snapshots a backend keeps in the pool (read-only subvolumes), each counted as its
    quota group's referenced bytes (`setting`: the key that sets `limit_bytes`, for the error)."""

    def __init__(self, setting: str, limit_bytes: int) -> None:
        super().__init__(setting, limit_bytes, referenced_bytes, delete_subvolume)


def referenced_bytes(path: Path) -> int:
    """What a subvolume holds (its quota group's referenced bytes, shared extents included)."""
    done = subprocess.run(
        ["btrfs", "qgroup", "show", "--raw", "--sync", "-rf", str(path)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise OSError(errno.EIO, f"cannot read the size of {path}: {(done.stderr or done.stdout).strip()}")
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].startswith("0/") and fields[1].isdigit():
            return int(fields[1])
    raise OSError(errno.EIO, f"no quota group found for {path}")


def bind_subvolume(subvolume: Path, target: Path, disk_base: int, own_base: int, count: int) -> None:
    """Mounts `subvolume` at `target` (nosuid, nodev), idmapped when its files carry another
    block's ids (disk_base) than the sandbox's own (own_base): host root stays host root."""
    userns = -1
    attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
    if disk_base != own_base:
        userns = make_user_namespace(own_base, count, disk_base, keep_host_root=True)
        attrs |= MOUNT_ATTR_IDMAP
    try:
        tree = detached_tree(str(subvolume), attrs, max(userns, 0), recursive=False)
    finally:
        if userns >= 0:
            os.close(userns)
    try:
        attach_tree(tree, target)
    finally:
        os.close(tree)


def _run(argv: list[str], step: str) -> None:
    run_step(argv, step, "the sandbox storage pool", timeout=120)
