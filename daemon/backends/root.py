"""A sandbox's user namespace and writable root filesystem, made by the daemon (as root, in the host's
mount namespace, under the sandbox's directory) before the launcher starts, for the local and the
singularity backends; the launcher binds the finished root at / and adds /proc, /dev, /run, /tmp
and the workdir.

- The user namespace maps ids 0 .. INSIDE_ID_COUNT - 1 inside to the sandbox's own block of host
  ids (daemon/uids.py). Only commands join it (nsenter --user): the mount, pid, ipc, uts, net and
  cgroup namespaces are created by root on the host, so they stay owned by the initial user
  namespace, and root inside, with capabilities in its own user namespace only, can neither mount,
  unmount nor remount anything, nor configure the network.
- The image's files are shown through idmapped mounts of that user namespace (read-only): what
  host root owns, root inside owns. Over them lies an overlay whose upper and work directories are
  on the sandbox's size-capped filesystem (diskcap.py): every path is writable inside, copies
  count against limits.disk_bytes, and the image never changes.
- A root filesystem directory is one overlay at /. The "host" image is a directory of the
  sandbox's own holding one overlay per operating-system directory (/usr, /etc, ...), the
  symlinks between them, read-only binds of `local.host_paths` (not idmapped: host root's files
  there are nobody's inside), empty covers over the daemon's own paths and over what the host's
  /etc keeps from other users (SecretScan), so that root inside reads no more of the host than
  any user could.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.sdk.errors import FailedPrecondition

from ..users import INSIDE_ID_COUNT
from .mount_api import (
    MOUNT_ATTR_IDMAP,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    attach_tree,
    check,
    detach,
    detached_tree,
    libc,
    make_user_namespace,
)

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_PRIVATE = 0x1, 0x2, 0x4, 1 << 18
# What the host's "etc" keeps from other users (shadow, private keys) is covered in "host" sandboxes.
SECRET_DIRS = ("/etc",)
# What a sandbox's init writes to its stdout once the sandbox's namespaces are up (the local
# launchers' inits, singularity's INIT_SCRIPT); the daemon waits for it before it enters them.
INIT_READY = b"corral-init-ready\n"


@dataclass(frozen=True)
class RootMount:
    """One step of building a sandbox root. kind: "overlay" (src's tree, idmapped, under a writable
    layer of the sandbox's own), "bind" (src read-only, as the host owns it), "link" (a symlink to
    src), "dir" (an empty directory, 0755, for a bind below it), "hide" (an empty read-only tmpfs)
    or "mask" (an empty file or directory that nobody inside may read, over a host secret)."""

    kind: str
    src: str
    dst: str


# -- the root --------------------------------------------------------------------------------------


def _mount(source: str, target: Path, fstype: str, flags: int, options: str) -> None:
    check(
        libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags, options.encode() or None),
        f"mount {fstype}",
        target,
    )


def _inside_id(host_id: int) -> int:
    """The id a host id of the image shows as inside (the idmapped view: unmapped ones are nobody)."""
    return host_id if host_id < INSIDE_ID_COUNT else 65534


def _overlay(src: str, dst: Path, layers: Path, name: str, first_id: int, userns_fd: int) -> None:
    """src's tree at dst, read-only and idmapped, under a writable layer in layers/name."""
    upper, work = layers / "upper" / name, layers / "work" / name
    upper.mkdir(parents=True, exist_ok=True)  # (a fork's child keeps its parent's, storage.py)
    work.mkdir(parents=True, exist_ok=True)
    # The overlay's top directory shows the upper directory's owner and mode: the image's own.
    top = os.stat(src)
    os.chown(upper, first_id + _inside_id(top.st_uid), first_id + _inside_id(top.st_gid))
    os.chmod(upper, stat.S_IMODE(top.st_mode))
    lower = detached_tree(src, MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY, userns_fd)
    try:
        options = f"lowerdir=/proc/self/fd/{lower},upperdir={upper},workdir={work}"
        _mount("corral-root", dst, "overlay", _MS_NOSUID | _MS_NODEV, options)
    finally:
        os.close(lower)


def _bind_read_only(src: str, dst: Path) -> None:
    tree = detached_tree(src, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    try:
        attach_tree(tree, dst)
    finally:
        os.close(tree)


def build_root(
    layout: Sequence[RootMount], sandbox_dir: Path, first_id: int, userns_fd: int, mountpoints: Sequence[str]
) -> Path:
    """Builds the sandbox's root at sandbox_dir/root from `layout` (local/launch.py's root_layout,
    or singularity's one overlay) and returns it; `mountpoints` are made for the launcher. Undone
    by unmount_root. What a fork's child finds there already (its parent's root directory and
    layers, as the fork copied them) is kept."""
    if os.path.ismount(sandbox_dir):
        # The sandbox's own filesystem: nothing mounted below it reaches other mount namespaces.
        _mount("none", sandbox_dir, "", _MS_PRIVATE, "")
    root, layers = sandbox_dir / "root", sandbox_dir / "layers"
    root.mkdir(exist_ok=True)
    layers.mkdir(mode=0o700, exist_ok=True)
    os.chown(root, first_id, first_id)  # root inside owns / (a "host" image's; an overlay shows its own)
    root.chmod(0o755)
    empty_dir, empty_file = layers / "empty-dir", layers / "empty-file"
    for n, m in enumerate(layout):
        dst = root / m.dst.lstrip("/")
        if m.kind == "overlay":
            dst.mkdir(exist_ok=True)
            _overlay(m.src, dst, layers, str(n), first_id, userns_fd)
        elif m.kind == "link":
            if not dst.is_symlink():
                dst.symlink_to(m.src)
        elif m.kind == "dir":
            dst.mkdir(mode=0o755, exist_ok=True)
            os.chown(dst, first_id, first_id)
        elif m.kind == "bind":
            dst.mkdir(exist_ok=True)
            _bind_read_only(m.src, dst)
        elif m.kind == "hide":
            _mount("corral-hidden", dst, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "mode=0755,size=4k")
        elif m.kind == "mask":
            cover = empty_dir if os.path.isdir(dst) else empty_file
            if not cover.exists():
                cover.mkdir(mode=0) if cover is empty_dir else cover.touch(mode=0)
            _bind_read_only(str(cover), dst)
    for path in mountpoints:
        target = root / path.lstrip("/")
        if not target.exists():
            target.mkdir(parents=True)
            os.chown(target, first_id, first_id)
    return root


@contextlib.contextmanager
def refusing_unbuildable(image: str) -> Iterator[None]:
    """Makes the kernel's refusal to build a root from `image` (build_root) FAILED_PRECONDITION;
    any other error is the node's (see sandboxes.node_error)."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            raise
        raise FailedPrecondition(
            f"cannot build the root of a sandbox of image {image}: {err} (the image must lie "
            "on a filesystem that supports idmapped mounts and can be an overlayfs layer, e.g. ext4, xfs, btrfs)"
        ) from err


def make_mount_points(root: Path, mounts: Sequence[tuple[str, bool]], first_id: int) -> None:
    """Makes each (sandbox path, is a directory) missing from the root, with its missing parents,
    as root inside owns them (mode 0755): a launcher would make them host root's, which root
    inside cannot enter."""
    for path, is_dir in mounts:
        target = root / path.lstrip("/")
        missing = [p for p in (*reversed(target.parents), target) if p.is_relative_to(root) and p != root]
        for part in missing:
            if part.exists() or part.is_symlink():
                continue
            if part == target and not is_dir:
                part.touch(mode=0o644)
            else:
                part.mkdir(mode=0o755)
            os.chown(part, first_id, first_id, follow_symlinks=False)


def unmount_root(sandbox_dir: Path) -> None:
    """Detaches a sandbox's root and everything mounted in it (nothing when there is none)."""
    root = sandbox_dir / "root"
    if os.path.ismount(root):
        detach(root)
    elif root.is_dir():
        # A "host" image's root is a directory holding the mounts.
        for entry in root.iterdir():
            if os.path.ismount(entry):
                detach(entry)


def secrets(dirs: Sequence[str] = SECRET_DIRS) -> list[str]:
    """The entries under `dirs` that other users may not read (a directory: list): what a
    "host" sandbox's root must not read either. Directories others cannot enter are not descended."""
    found = []
    for top in dirs:
        for parent, subdirs, files in os.walk(top):
            for name in [*subdirs, *files]:
                path = os.path.join(parent, name)
                try:
                    mode = os.lstat(path).st_mode
                except OSError:
                    continue
                if not stat.S_ISLNK(mode) and not mode & stat.S_IROTH:
                    found.append(path)
            subdirs[:] = [d for d in subdirs if os.path.join(parent, d) not in found]
    return found


def kernel_support() -> str:
    """ "" when this kernel can build sandbox roots (user namespaces, idmapped mounts, overlayfs
    over an idmapped layer), else why not."""
    with tempfile.TemporaryDirectory(prefix="corral-idmap-probe-") as scratch:
        lower, merged, layers = (Path(scratch) / n for n in ("lower", "merged", "layers"))
        lower.mkdir()
        merged.mkdir()
        try:
            userns = make_user_namespace(0, 1)
        except OSError as err:
            return f"no user namespaces ({err.strerror or err})"
        try:
            _overlay(str(lower), merged, layers, "0", 0, userns)
            detach(merged)
        except OSError as err:
            return f"no overlayfs over idmapped mounts (Linux 5.19 or later): {err}"
        finally:
            os.close(userns)
    return ""
