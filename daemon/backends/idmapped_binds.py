"""Host bind mounts of container sandboxes (Docker, Podman, Apptainer), shown through the sandbox's
block of host ids.

Programs in those containers run as the host's own ids (root inside is host uid 0, with
capabilities cut: docs/backends.md). The engine is therefore never given a host path itself: the
daemon makes an idmapped mount of it (open_tree, then mount_setattr MOUNT_ATTR_IDMAP), not
recursive, nosuid, nodev, read-only unless asked, at a staging path of the sandbox's own under
its state directory (binds/<backend>/<sandbox id>/<n>), and the engine binds that (a bind of an
idmapped mount keeps its idmapping). The idmapping is the sandbox's block read backwards: host id
first + n is id n on the mount, for n in 0 .. 65535, and no other host id is mapped. So

- what id n inside creates on the mount belongs on the host to first + n (root's files to the
  block's first id), as on the local backend, where the same ids are the processes' own;
- host files of the block show as their inside ids, every other host file (host root's
  included) as nobody (65534): root inside reads them as "others" may, and can neither write,
  chmod, chown nor remove-by-override them, nor create files in such a directory, whatever its
  mode (the kernel refuses to write an inode whose owner the mount cannot map). A writable mount
  is writable where its files belong to the sandbox's ids.

A filesystem the kernel cannot idmap is refused (FAILED_PRECONDITION) rather than bound as is:
an unmapped writable bind would hand host root's files to root inside. Staging mounts are
detached when the sandbox goes and by a restarted daemon (`unstage_all`); nothing here ever
deletes through a mount (only empty mount points are removed, after their mount is gone).
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Sequence
from pathlib import Path

from corral.sdk.errors import FailedPrecondition

from ..fsaccess import openat2
from ..users import INSIDE_ID_COUNT
from .base import BindMount
from .mount_api import (
    MOUNT_ATTR_IDMAP,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    attach_tree,
    detach,
    detached_tree,
    make_user_namespace,
)

NOBODY = 65534  # how a host id outside the block shows on the mount (the kernel's overflow id)


def staging_root(state_dir: Path, backend: str) -> Path:
    """Where a backend's sandboxes keep their staging mounts."""
    return state_dir / "binds" / backend


def staging_dir(state_dir: Path, backend: str, sandbox_id: str) -> Path:
    """Where a sandbox keeps its staging mounts."""
    return staging_root(state_dir, backend) / sandbox_id


def release_staging(state_dir: Path, backend: str, record: dict) -> None:
    """Removes the staging mounts of a sandbox a stopped daemon left, from its record."""
    sandbox_id = record.get("sandbox_id", "")
    if sandbox_id and "/" not in sandbox_id and sandbox_id not in (".", ".."):
        unstage(staging_dir(state_dir, backend, sandbox_id))


def shown_id(host_id: int, first_id: int) -> int:
    """The id a host file's owner shows as on a sandbox's idmapped mount."""
    return host_id - first_id if first_id <= host_id < first_id + INSIDE_ID_COUNT else NOBODY


def stage(mounts: Sequence[BindMount], first_id: int, directory: Path) -> tuple[BindMount, ...]:
    """Makes `directory`/<n> an idmapped mount of each mount's host path (see the module
    docstring) and returns the mounts with those staging paths as host paths, for the engine.
    FAILED_PRECONDITION when a host path's filesystem cannot be idmapped; what was made is undone
    on any error."""
    if not mounts:
        return ()
    directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.mkdir(mode=0o700)
    staged = []
    try:
        userns = make_user_namespace(0, INSIDE_ID_COUNT, inside_first=first_id)
        try:
            for n, mount in enumerate(mounts):
                point = directory / str(n)
                if os.path.isdir(mount.host_path):
                    point.mkdir(mode=0o700)
                else:
                    point.touch(mode=0o600)
                _mount_idmapped(mount, point, userns)
                staged.append(BindMount(str(point), mount.sandbox_path, mount.read_only))
        finally:
            os.close(userns)
    except BaseException:
        unstage(directory)
        raise
    return tuple(staged)


def _mount_idmapped(mount: BindMount, point: Path, userns: int) -> None:
    attrs = MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if mount.read_only else 0)
    try:
        tree = detached_tree(mount.host_path, attrs, userns, recursive=False)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            raise  # the node's (see sandboxes.node_error)
        raise FailedPrecondition(
            f"mount host_path {mount.host_path} cannot be shown through the sandbox's ids: its filesystem "
            f"does not support idmapped mounts ({err.strerror}); use a directory on e.g. ext4, xfs, btrfs or tmpfs"
        ) from err
    try:
        attach_tree(tree, point)
    finally:
        os.close(tree)


def check_shown(mounts: Sequence[BindMount], first_id: int, init_pid: int, idmapped: bool = True) -> None:
    """FAILED_PRECONDITION unless each mount shows, inside the container of `init_pid`, its host
    path through the sandbox's ids: the engine bound the staging mount (not the empty mount point
    of a daemon whose mounts it cannot see) and kept its idmapping (a plain bind, not `idmapped`:
    its host ids)."""
    shown = functools.partial(shown_id, first_id=first_id) if idmapped else int
    root = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for mount in mounts:
            host = os.stat(mount.host_path)
            try:
                fd = openat2(root, mount.sandbox_path, os.O_PATH)
            except OSError as err:
                raise FailedPrecondition(f"mount {mount.sandbox_path} is missing in the container: {err}") from err
            try:
                inside = os.fstat(fd)
            finally:
                os.close(fd)
            if (inside.st_dev, inside.st_ino) != (host.st_dev, host.st_ino) or (inside.st_uid, inside.st_gid) != (
                shown(host.st_uid),
                shown(host.st_gid),
            ):
                raise FailedPrecondition(
                    f"mount {mount.sandbox_path} does not show {mount.host_path} through the sandbox's ids in the "
                    "container (the daemon and the engine must share the host's mount namespace)"
                )
    finally:
        os.close(root)


def unstage(directory: Path) -> None:
    """Detaches a sandbox's staging mounts and removes their mount points and `directory` (nothing
    when there is none). A mount point still in use is left, never deleted through."""
    if not directory.is_dir():
        return
    for point in directory.iterdir():
        while detach(point):
            pass  # stacked mounts, one by one
        if point.is_dir() and not point.is_symlink():
            point.rmdir()
        else:
            point.unlink()
    directory.rmdir()


def unstage_all(root: Path) -> None:
    """Removes every staging mount under `root` (staging_root): what a stopped daemon left."""
    if root.is_dir():
        for directory in root.iterdir():
            unstage(directory)
