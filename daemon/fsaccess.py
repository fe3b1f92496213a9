"""File operations inside a sandbox, done by the daemon without entering it.

Paths are resolved with openat2(RESOLVE_IN_ROOT) against a directory fd of the sandbox's root
(/proc/<init>/root for namespace sandboxes), so `..` and symlinks, absolute or relative, stay
inside the sandbox. While an operation runs, its thread takes the sandbox user's identity
(per-thread setresuid/setresgid/setgroups through raw syscalls; glibc's wrappers would switch every
thread), so the kernel applies the same permission checks as for a process in the sandbox: a
sandbox cannot read /etc/shadow this way either, nor write where its user may not (on the local
backend, the user is the sandbox's default one, as its mapped host ids).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from corral.sdk.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

from .errors import from_os_error

_libc = ctypes.CDLL(None, use_errno=True)
# Syscall numbers differ per architecture; glibc exports no per-thread wrappers for these.
_SYSCALLS = {
    "x86_64": {"openat2": 437, "setgroups": 116, "setresuid": 117, "setresgid": 119},
    "aarch64": {"openat2": 437, "setgroups": 159, "setresuid": 147, "setresgid": 149},
}[platform.machine()]
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
KEEP = 0xFFFFFFFF  # "leave unchanged" for setres[ug]id
MAX_OFFSET = (1 << 63) - 1
# Uploads are unpacked into a hidden directory of this prefix inside their destination, then moved.
STAGING_PREFIX = ".corral-upload-"


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _syscall(name: str, *args) -> int:
    result = _libc.syscall(_SYSCALLS[name], *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def openat2(root_fd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    return _syscall(
        "openat2", ctypes.c_int(root_fd), path.encode(), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how))
    )


def create_private_file(path: str | os.PathLike[str], mode: int) -> int:
    """Creates a fresh file for the daemon in a directory the sandbox user owns (its run
    directory) and returns a write fd. Whatever the sandbox left under that name (a symlink to a
    host file, a fifo) is unlinked, never followed: the fd always refers to the daemon's own new
    inode, owned by root, so writing to it can never land outside."""
    directory, name = os.path.split(os.fspath(path))
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(name, dir_fd=dir_fd)
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def create_private_fifo(path: str | os.PathLike[str], mode: int) -> tuple[int, int]:
    """Like create_private_file, for a fifo the sandbox writes and the daemon reads: returns its
    read end and a write end the daemon keeps open (so that the read end never sees end-of-file
    when the sandbox's writers come and go), both non-blocking. The ends are opened once, checked
    to be the daemon's own new fifo, and the mode set through the fd: a name the sandbox swaps
    meanwhile makes this fail, never reach elsewhere."""
    directory, name = os.path.split(os.fspath(path))
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(name, dir_fd=dir_fd)
        os.mkfifo(name, 0o600, dir_fd=dir_fd)
        read_end = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(read_end)
        if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, "the fifo was replaced while it was created", os.fspath(path))
        os.fchmod(read_end, mode)
        # The same pipe again, through the fd rather than the name.
        write_end = os.open(f"/proc/self/fd/{read_end}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except BaseException:
        os.close(read_end)
        raise
    return read_end, write_end


PASSWD_MAX_BYTES = 1 << 20


def read_passwd(root: str) -> str:
    """The /etc/passwd of the root filesystem at `root` (a host directory), resolved inside it like
    every path here ("" where it has none, or something other than a file of at most
    PASSWD_MAX_BYTES)."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = openat2(root_fd, "etc/passwd", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    finally:
        os.close(root_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > PASSWD_MAX_BYTES:
            return ""
        return os.pread(fd, PASSWD_MAX_BYTES, 0).decode(errors="replace")
    finally:
        os.close(fd)


@contextlib.contextmanager
def _as_user(uid: int | None, gid: int | None) -> Iterator[None]:
    """Takes the sandbox user's identity in this thread only (euid/egid; saved ids stay root)."""
    if uid is None or os.geteuid() != 0:
        yield
        return
    assert gid is not None, "a sandbox uid comes with its gid"
    groups = (ctypes.c_uint * 1)(gid)
    _syscall("setgroups", ctypes.c_size_t(1), groups)
    _syscall("setresgid", ctypes.c_uint(KEEP), ctypes.c_uint(gid), ctypes.c_uint(KEEP))
    _syscall("setresuid", ctypes.c_uint(KEEP), ctypes.c_uint(uid), ctypes.c_uint(KEEP))
    try:
        yield
    finally:
        _syscall("setresuid", ctypes.c_uint(KEEP), ctypes.c_uint(0), ctypes.c_uint(KEEP))
        _syscall("setresgid", ctypes.c_uint(KEEP), ctypes.c_uint(0), ctypes.c_uint(KEEP))
        root_groups = (ctypes.c_uint * 1)(0)
        _syscall("setgroups", ctypes.c_size_t(1), root_groups)


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    kind: str  # file | directory | symlink | other
    size: int
    mode: int
    modified_ns: int
    symlink_target: str


def _printable(name: str) -> str:
    # Names are bytes on Linux; the contract carries UTF-8 strings.
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


class SandboxFiles:
    """Blocking file operations in one sandbox's root; call them from a worker thread."""

    def __init__(self, root_path: str, workdir: str, uid: int | None, gid: int | None, max_bytes: int):
        self.root_fd = os.open(root_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.workdir = workdir
        self.uid, self.gid = uid, gid
        self.max_bytes = max_bytes

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.root_fd)

    def absolute(self, path: str) -> str:
        if not path:
            raise InvalidArgument("path is empty")
        if "\0" in path:
            raise InvalidArgument("path contains a NUL byte")
        return os.path.normpath(path if path.startswith("/") else os.path.join(self.workdir, path))

    def _open(self, path: str, flags: int, mode: int = 0, creating: bool = False) -> int:
        """`creating`: the caller makes something at or under `path`, so a file where a directory
        should be is the caller's mistake (INVALID_ARGUMENT), not a missing path."""
        try:
            return openat2(self.root_fd, path, flags, mode)
        except OSError as err:
            if creating and err.errno == errno.ENOTDIR:
                raise InvalidArgument(f"{path}: a file is where a directory should be") from err
            raise from_os_error(err, path) from err

    def read(self, path: str, offset: int, limit: int) -> tuple[bytes, int, bool]:
        path = self.absolute(path)
        if offset > MAX_OFFSET:
            raise InvalidArgument(f"offset {offset} is past any file's end")
        with _as_user(self.uid, self.gid):
            # O_NONBLOCK: opening a fifo the sandbox made must not park a daemon thread forever.
            fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise InvalidArgument(f"{path}: is a directory")
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidArgument(f"{path}: not a regular file")
                if not limit and st.st_size - offset > self.max_bytes:
                    raise FailedPrecondition(
                        f"{path}: {st.st_size - offset} bytes from offset {offset} is more than one ReadFile"
                        f" returns ({self.max_bytes} bytes): use Download, or read it in ranges (offset, limit_bytes)"
                    )
                data = os.pread(fd, min(limit or self.max_bytes, self.max_bytes), offset)
            except OSError as err:
                raise from_os_error(err, path) from err
            finally:
                os.close(fd)
        return data, st.st_size, offset + len(data) < st.st_size

    def write(self, path: str, data: bytes, mode: int, make_parents: bool) -> int:
        path = self.absolute(path)
        if len(data) > self.max_bytes:
            raise ResourceExhausted(f"{path}: {len(data)} bytes is over the {self.max_bytes}-byte file cap")
        mode = mode or 0o644
        if mode & ~0o7777:
            raise InvalidArgument(f"mode {oct(mode)} is not a permission mask")
        with _as_user(self.uid, self.gid):
            if make_parents:
                self._make_dirs(os.path.dirname(path))
            fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode, creating=True)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise InvalidArgument(f"{path}: not a regular file")
                os.fchmod(fd, mode)  # the daemon's umask must not change what was asked for
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as err:
                raise from_os_error(err, path) from err
            finally:
                os.close(fd)
        return len(data)

    def _make_dirs(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        current = "/"
        for part in parts:
            parent = self._open(current, os.O_PATH | os.O_DIRECTORY, creating=True)
            try:
                os.mkdir(part, 0o755, dir_fd=parent)
            except FileExistsError:
                pass
            except OSError as err:
                raise from_os_error(err, os.path.join(current, part)) from err
            finally:
                os.close(parent)
            current = os.path.join(current, part)

    def make_dirs(self, path: str) -> str:
        path = self.absolute(path)
        with _as_user(self.uid, self.gid):
            self._make_dirs(path)
            os.close(self._open(path, os.O_PATH | os.O_DIRECTORY, creating=True))
        return path

    def make_staging_dir(self, path: str) -> None:
        """Makes the private directory `path` (absolute, its name starting with STAGING_PREFIX)
        inside an existing directory, on the same filesystem as that directory, so that what is
        unpacked there can be renamed into place."""
        directory, name = os.path.split(path)
        assert name.startswith(STAGING_PREFIX), path
        with _as_user(self.uid, self.gid):
            parent = self._open(directory, os.O_PATH | os.O_DIRECTORY, creating=True)
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except OSError as err:
                raise from_os_error(err, directory) from err
            finally:
                os.close(parent)

    def move_into(self, staging: str, directory: str) -> None:
        """Moves everything in `staging` into `directory` as `tar -x` would have written it there:
        a new entry replaces a file or link of the same name (one rename each), and a directory
        that exists on both sides is merged, entry by entry. An entry that would replace a
        non-empty directory with a non-directory fails the whole move before anything moves."""
        with _as_user(self.uid, self.gid):
            source = self._open(staging, os.O_RDONLY | os.O_DIRECTORY)
            target = self._open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _refuse_conflicts(source, target, directory)
                _merge(source, target)
            except OSError as err:
                raise from_os_error(err, directory) from err
            finally:
                os.close(source)
                os.close(target)

    def remove_tree(self, path: str) -> None:
        """Removes a directory and everything in it, never following a symlink."""
        parent, name = os.path.split(path)
        with _as_user(self.uid, self.gid):
            parent_fd = self._open(parent, os.O_PATH | os.O_DIRECTORY)
            try:
                shutil.rmtree(name, dir_fd=parent_fd)
            except FileNotFoundError:
                pass
            except OSError as err:
                raise from_os_error(err, path) from err
            finally:
                os.close(parent_fd)

    def kind(self, path: str) -> tuple[str, str]:
        """(absolute path, kind) of an existing path; NotFound otherwise."""
        path = self.absolute(path)
        with _as_user(self.uid, self.gid):
            fd = self._open(path, os.O_PATH)
            try:
                return path, _kind(os.fstat(fd).st_mode)
            finally:
                os.close(fd)

    def list(self, path: str) -> list[Entry]:
        path = self.absolute(path)
        entries = []
        with _as_user(self.uid, self.gid):
            fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with os.scandir(fd) as it:
                    for item in it:
                        try:
                            st = item.stat(follow_symlinks=False)
                            target = os.readlink(item.name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
                        except FileNotFoundError:
                            continue  # removed while the directory was read (say, by an upload's cleanup)
                        entries.append(
                            Entry(
                                name=_printable(item.name),
                                path=_printable(os.path.join(path, item.name)),
                                kind=_kind(st.st_mode),
                                size=st.st_size,
                                mode=stat.S_IMODE(st.st_mode),
                                modified_ns=st.st_mtime_ns,
                                symlink_target=_printable(target),
                            )
                        )
            except OSError as err:
                if err.errno == errno.ENOTDIR:
                    raise InvalidArgument(f"{path}: not a directory") from err
                raise from_os_error(err, path) from err
            finally:
                os.close(fd)
        return sorted(entries, key=lambda e: e.name)


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open_subdir(name: str, dir_fd: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _refuse_conflicts(source: int, target: int, path: str) -> None:
    """InvalidArgument when a non-directory of `source` would replace a non-empty directory of
    `target` (tar refuses that too); recurses where both sides are directories."""
    for name in os.listdir(source):
        new, old = _lstat(name, source), _lstat(name, target)
        if new is None or old is None or not stat.S_ISDIR(old.st_mode):
            continue
        if stat.S_ISDIR(new.st_mode):
            sub_source, sub_target = _open_subdir(name, source), _open_subdir(name, target)
            try:
                _refuse_conflicts(sub_source, sub_target, os.path.join(path, name))
            finally:
                os.close(sub_source)
                os.close(sub_target)
        elif _nonempty(name, target):
            raise InvalidArgument(
                f"{os.path.join(path, _printable(name))}: a directory is in the way of the uploaded file"
            )


def _nonempty(name: str, dir_fd: int) -> bool:
    fd = _open_subdir(name, dir_fd)
    try:
        return bool(os.listdir(fd))
    finally:
        os.close(fd)


def _merge(source: int, target: int) -> None:
    for name in os.listdir(source):
        new, old = _lstat(name, source), _lstat(name, target)
        assert new is not None  # only this move takes entries out of the staging directory
        if old is not None and stat.S_ISDIR(old.st_mode) and stat.S_ISDIR(new.st_mode):
            sub_source, sub_target = _open_subdir(name, source), _open_subdir(name, target)
            try:
                _merge(sub_source, sub_target)
            finally:
                os.close(sub_source)
                os.close(sub_target)
            continue
        if old is not None and (stat.S_ISDIR(old.st_mode) or stat.S_ISDIR(new.st_mode)):
            # rename() replaces a file by a file or an empty directory by a directory only.
            if stat.S_ISDIR(old.st_mode):
                os.rmdir(name, dir_fd=target)  # empty: _refuse_conflicts checked
            else:
                os.unlink(name, dir_fd=target)
        os.rename(name, name, src_dir_fd=source, dst_dir_fd=target)
