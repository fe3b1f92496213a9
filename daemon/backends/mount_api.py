"""The kernel's new mount API (open_tree, mount_setattr, move_mount) and user namespaces, as the
daemon uses them to show host trees to a sandbox through its block of host ids: a sandbox's root
on the local and singularity backends (root.py) and the host bind mounts of container sandboxes
(idmapped_binds.py)."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess

from ..users import INSIDE_ID_COUNT

libc = ctypes.CDLL(None, use_errno=True)
# x86-64 and aarch64 share the numbers of the new mount API.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD, _AT_EMPTY_PATH, _AT_RECURSIVE = -100, 0x1000, 0x8000
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC = 0x1, 0x80000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000
_MNT_DETACH, _UMOUNT_NOFOLLOW = 0x2, 0x8


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def check(result: int, what: str, path: str | os.PathLike[str] = "") -> int:
    """`result` of a libc call, or the OSError its errno says."""
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", os.fspath(path) if path else None)
    return result


def make_user_namespace(
    first_id: int, count: int = INSIDE_ID_COUNT, inside_first: int = 0, *, keep_host_root: bool = False
) -> int:
    """A new user namespace mapping ids inside_first .. inside_first + count - 1 in it to host ids
    first_id .. first_id + count - 1 (uids and gids), as a file descriptor (which keeps it alive)
    for nsenter and idmapped mounts; with keep_host_root, id 0 to host id 0 as well (an idmapped
    mount of the daemon's own directories that must stay root's). The process that makes it
    (unshare: a multithreaded daemon may not) exits once it is mapped."""
    maker = subprocess.Popen(
        ["unshare", "--user", "--", "/bin/sh", "-c", "echo ready; read -r _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        cwd="/",
    )
    assert maker.stdin is not None and maker.stdout is not None and maker.stderr is not None
    try:
        if maker.stdout.readline() != b"ready\n":
            said = maker.stderr.read().decode(errors="replace").strip()
            raise OSError(errno.EPERM, f"cannot make a user namespace: {said or 'unshare --user failed'}")
        for kind in ("uid", "gid"):
            with open(f"/proc/{maker.pid}/{kind}_map", "w") as fh:
                fh.write(("0 0 1\n" if keep_host_root else "") + f"{inside_first} {first_id} {count}\n")
        return os.open(f"/proc/{maker.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        maker.stdin.close()
        maker.wait()
        maker.stdout.close()
        maker.stderr.close()


def detached_tree(src: str, attr_set: int, userns_fd: int = 0, recursive: bool = True) -> int:
    """A private copy of the mount at `src` (with every mount below it when `recursive`), not
    attached anywhere yet, with `attr_set` (MOUNT_ATTR_*) on every mount of it."""
    deep = _AT_RECURSIVE if recursive else 0
    tree = check(
        libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(src), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | deep),
        "open_tree",
        src,
    )
    try:
        attr = _MountAttr(attr_set, 0, 0, userns_fd)
        check(
            libc.syscall(
                _SYS_MOUNT_SETATTR,
                tree,
                b"",
                _AT_EMPTY_PATH | deep,
                ctypes.byref(attr),
                ctypes.c_size_t(ctypes.sizeof(attr)),
            ),
            "mount_setattr",
            src,
        )
    except BaseException:
        os.close(tree)
        raise
    return tree


def attach_tree(tree: int, dst: str | os.PathLike[str]) -> None:
    """Attaches a detached tree at `dst`."""
    check(
        libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(dst), _MOVE_MOUNT_F_EMPTY_PATH),
        "move_mount",
        dst,
    )


def detach(path: str | os.PathLike[str]) -> bool:
    """Lazily unmounts what is mounted at `path` (a symlink there is not followed); False when
    nothing is (EINVAL)."""
    if libc.umount2(os.fsencode(path), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
        return True
    if ctypes.get_errno() != errno.EINVAL:
        check(-1, "umount", path)
    return False
