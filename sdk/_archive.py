"""Tar archives for Upload and Download: packing a local file or directory into bounded chunks, and
unpacking a received archive safely.

Sans-IO with respect to the wire: both clients feed these the bytes they send or receive.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from corral.sdk.errors import InvalidArgument, ProtocolError

# Size of each Upload chunk, and so the most archive bytes held in memory while packing (a file's
# content is read in pieces of this size). Well under gRPC's 4 MiB default message cap.
UPLOAD_CHUNK_BYTES = 1 << 20
# A downloaded archive is kept in memory up to this size, then spills to a temporary file; it is
# unpacked only once complete, so a failed download leaves nothing half-extracted.
DOWNLOAD_SPOOL_MEMORY_BYTES = 8 << 20

_BLOCK = tarfile.BLOCKSIZE
# Piece size when unpacking a file; an all-zero piece becomes a hole instead of being written.
_COPY_BYTES = 1 << 16
_ZEROS = bytes(_COPY_BYTES)


def archive_name(local_path: str | os.PathLike[str]) -> str:
    """The name a local file or directory is stored under in an upload archive: its base name."""
    name = os.path.basename(os.path.abspath(local_path))
    if not name:
        raise InvalidArgument(f"cannot upload {os.fspath(local_path)!r}: it has no base name to store it under")
    return name


def tar_chunks(local_path: str | os.PathLike[str], chunk_bytes: int = UPLOAD_CHUNK_BYTES) -> Iterator[bytes]:
    """A tar archive (PAX format) of a local file or directory, stored under its base name, as
    pieces of at most `chunk_bytes`.

    A missing `local_path` raises here, before any call starts; the archive itself is produced
    lazily as the pieces are consumed.
    """
    name = archive_name(local_path)
    # A symlink given as the root means its target, stored under the name given.
    root = Path(os.path.realpath(local_path))
    os.stat(root)
    return _tar_stream(root, name, chunk_bytes)


def _tar_stream(root: Path, arcname: str, chunk_bytes: int) -> Iterator[bytes]:
    """tarfile's own writer takes a whole file per call, so the archive is assembled here from
    tarfile's headers plus file content read piece by piece: memory stays bounded by `chunk_bytes`
    whatever the file sizes. Symlinks are stored as links; sockets, fifos and devices are skipped.
    """
    # Only gettarinfo() is used: it turns stat results into headers and remembers inodes, so hard
    # links within the tree are stored once. Nothing is written to this TarFile.
    headers = tarfile.TarFile(fileobj=io.BytesIO(), mode="w", format=tarfile.PAX_FORMAT)
    pending = bytearray()
    for path, name in _walk(root, arcname):
        info = headers.gettarinfo(str(path), name)
        if info is None or not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
            continue
        pending += info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
        if info.isreg():
            with open(path, "rb") as content:
                remaining = info.size
                while remaining:
                    piece = content.read(min(chunk_bytes, remaining))
                    if not piece:
                        raise OSError(f"{path} shrank while it was being archived")
                    pending += piece
                    remaining -= len(piece)
                    yield from _full_chunks(pending, chunk_bytes)
            pending += b"\0" * (-info.size % _BLOCK)
        yield from _full_chunks(pending, chunk_bytes)
    pending += b"\0" * (2 * _BLOCK)  # end-of-archive marker
    yield from _full_chunks(pending, chunk_bytes)
    if pending:
        yield bytes(pending)


def _walk(root: Path, arcname: str) -> Iterator[tuple[Path, str]]:
    """The root, then (for a directory) everything below it in sorted order, with archive names."""
    yield root, arcname
    if not root.is_dir():
        return
    # followlinks=False: a symlink to a directory is listed in dirnames but stored as a link.
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        relative = Path(directory).relative_to(root)
        for entry in sorted(dirnames + filenames):
            yield Path(directory, entry), (Path(arcname) / relative / entry).as_posix()


def _full_chunks(pending: bytearray, chunk_bytes: int) -> Iterator[bytes]:
    """Takes complete chunks off the front of `pending`."""
    while len(pending) >= chunk_bytes:
        yield bytes(pending[:chunk_bytes])
        del pending[:chunk_bytes]


def download_spool() -> IO[bytes]:
    """A file to collect a downloaded archive in (memory first, disk past a threshold)."""
    return tempfile.SpooledTemporaryFile(max_size=DOWNLOAD_SPOOL_MEMORY_BYTES)


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuses, before anything is written, an archive the daemon would never send: absolute
    names, `..`, hard links to anything but an earlier member's path, special files. A symlink may
    point anywhere (a venv's bin/python -> /usr/bin/python3): it is created as a link and never
    followed, here or by later members (see `_Unpacker`)."""
    if _escapes(member.name):
        raise ProtocolError(f"the downloaded archive has an unsafe member name: {member.name!r}")
    if member.islnk():
        if _escapes(member.linkname) or not _parts(member.linkname):
            raise ProtocolError(f"the downloaded archive has a link leaving it: {member.name!r} -> {member.linkname!r}")
    elif not (member.isfile() or member.isdir() or member.issym()):
        raise ProtocolError(f"the downloaded archive has a special file: {member.name!r}")


def _escapes(name: str) -> bool:
    return name.startswith("/") or ".." in PurePosixPath(name).parts


def _parts(name: str) -> list[str]:
    return [part for part in PurePosixPath(name).parts if part not in ("/", ".")]


class _Unpacker:
    """Writes members below one directory through directory fds, component by component, never
    following a symlink below that directory (O_NOFOLLOW on every step): a link the archive made
    (or one already there) can be replaced by a member of the same name but never written through.
    Files get their permission bits without set-id, sticky or group/other-write bits and belong to
    whoever unpacks them; runs of zeros become holes, so sparse files stay sparse."""

    def __init__(self, tar: tarfile.TarFile, destination: Path) -> None:
        self.tar = tar
        self.root_fd = os.open(destination, os.O_RDONLY | os.O_DIRECTORY)

    def close(self) -> None:
        os.close(self.root_fd)

    def _parent(self, parts: list[str], name: str) -> int:
        """A new fd of the directory holding `parts[-1]`, creating missing directories."""
        fd = os.dup(self.root_fd)
        try:
            for part in parts[:-1]:
                try:
                    next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as error:
                    if error.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise ProtocolError(
                            f"the downloaded archive would write {name!r} through {part!r}, which is not a directory"
                            " (a symlink is never followed)"
                        ) from error
                    raise
                os.close(fd)
                fd = next_fd
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _clear(parent_fd: int, name: str) -> None:
        """Removes a non-directory in the way of a new member (tar's own behaviour: replace)."""
        try:
            if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass

    def member(self, member: tarfile.TarInfo) -> None:
        parts = _parts(member.name)
        if not parts:  # the destination itself (an archive of "/")
            return
        parent_fd = self._parent(parts, member.name)
        name = parts[-1]
        try:
            if member.isdir():
                try:
                    os.mkdir(name, 0o755, dir_fd=parent_fd)
                except FileExistsError:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                        raise ProtocolError(
                            f"the downloaded directory {member.name!r} would replace a file or link"
                        ) from None
                return
            self._clear(parent_fd, name)
            if member.issym():
                os.symlink(member.linkname, name, dir_fd=parent_fd)
            elif member.islnk():
                target = _parts(member.linkname)
                target_fd = self._parent(target, member.linkname)
                try:
                    os.link(target[-1], name, src_dir_fd=target_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
                finally:
                    os.close(target_fd)
            else:
                self._file(member, parent_fd, name)
        finally:
            os.close(parent_fd)

    def _file(self, member: tarfile.TarInfo, parent_fd: int, name: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(name, flags, 0o600, dir_fd=parent_fd)
        try:
            source = self.tar.extractfile(member)
            assert source is not None  # a regular file
            # A sparse member carries its data regions; read only those, not its holes.
            # (typeshed calls `sparse` an int; tarfile sets a list of (offset, size) or None.)
            sparse: list[tuple[int, int]] | None = getattr(member, "sparse", None)
            regions = sparse if sparse is not None else [(0, member.size)]
            for offset, length in regions:
                source.seek(offset)
                _copy_skipping_zeros(source, fd, offset, length)
            os.ftruncate(fd, member.size)
            mode = member.mode & 0o755 | 0o600
            os.fchmod(fd, mode if mode & 0o100 else mode & ~0o111)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)


def _copy_skipping_zeros(source: IO[bytes], fd: int, offset: int, length: int) -> None:
    """Copies `length` bytes to `fd` at `offset`, seeking over all-zero pieces instead of writing
    them (the caller sets the final size)."""
    end = offset + length
    while offset < end:
        piece = source.read(min(_COPY_BYTES, end - offset))
        if not piece:
            raise ProtocolError("the downloaded archive ends inside a file")
        if piece != (_ZEROS if len(piece) == _COPY_BYTES else bytes(len(piece))):
            view = memoryview(piece)
            position = offset
            while view:
                written = os.pwrite(fd, view, position)
                view, position = view[written:], position + written
        offset += len(piece)


def extract_archive(archive: IO[bytes], local_dir: str | os.PathLike[str]) -> Path:
    """Unpacks a complete tar archive into `local_dir` (created if missing) and returns the path of
    its top-level entry.

    Every member is checked before anything is written (`_check_member`), and none is written
    through a symlink (`_Unpacker`), so an archive from a compromised sandbox cannot write outside
    the target directory. Symlinks are recreated as they were, whatever they point to.
    """
    destination = Path(local_dir)
    destination.mkdir(parents=True, exist_ok=True)
    archive.seek(0)
    try:
        with tarfile.open(fileobj=archive, mode="r:", errorlevel=2) as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member)
            unpacker = _Unpacker(tar, destination)
            try:
                for member in members:
                    unpacker.member(member)
            finally:
                unpacker.close()
    except tarfile.TarError as error:
        raise ProtocolError(f"the downloaded archive cannot be unpacked safely: {error}") from error
    if not members:
        raise ProtocolError("the downloaded archive is empty")
    top = _parts(members[0].name)
    return destination / top[0] if top else destination
