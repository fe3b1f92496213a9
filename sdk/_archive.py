"""Tar archives for Upload and Download: packing a local file or directory into bounded chunks, and
unpacking a received archive safely.

Sans-IO with respect to the wire: both clients feed these the bytes they send or receive.
"""

from __future__ import annotations

import copy
import io
import os
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
    """Our own check before tarfile's "data" filter, which some Python releases could be tricked
    past (fixed in 3.11.13/3.12.11/3.13.4): no absolute names, no `..`, no link that leaves the
    archive's tree, nothing but files, directories and links."""

    def escapes(name: str) -> bool:
        parts = PurePosixPath(name).parts
        return name.startswith("/") or ".." in parts

    if escapes(member.name):
        raise ProtocolError(f"the downloaded archive has an unsafe member name: {member.name!r}")
    if member.issym() or member.islnk():
        target = member.linkname if member.islnk() else str(PurePosixPath(member.name).parent / member.linkname)
        if member.linkname.startswith("/") or _leaves(target):
            raise ProtocolError(f"the downloaded archive has a link leaving it: {member.name!r} -> {member.linkname!r}")
    elif not (member.isfile() or member.isdir()):
        raise ProtocolError(f"the downloaded archive has a special file: {member.name!r}")


def _leaves(path: str) -> bool:
    depth = 0
    for part in PurePosixPath(path).parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in (".", "/"):
            depth += 1
    return False


def _extract_data(tar: tarfile.TarFile, destination: Path, members: list[tarfile.TarInfo]) -> None:
    """extractall with tarfile's "data" filter, or, on Pythons that predate extraction filters
    (before 3.11.4, e.g. Debian 12's 3.11.2), with what that filter does beyond `_check_member`:
    no set-id, sticky or group/other-write bits, and files owned by whoever unpacks them."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(destination, members=members, filter="data")
        return
    safe = []
    for member in members:
        member = copy.copy(member)
        member.mode &= 0o755
        member.uid, member.gid = os.getuid(), os.getgid()
        member.uname = member.gname = ""  # no lookup by name: the numeric ids above are used
        safe.append(member)
    tar.extractall(destination, members=safe)


def extract_archive(archive: IO[bytes], local_dir: str | os.PathLike[str]) -> Path:
    """Unpacks a complete tar archive into `local_dir` (created if missing) and returns the path of
    its top-level entry.

    tarfile's "data" filter refuses absolute paths, `..`, links pointing outside `local_dir`,
    device files, and drops set-uid bits, so an archive from a compromised sandbox cannot write
    outside the target directory.
    """
    destination = Path(local_dir)
    destination.mkdir(parents=True, exist_ok=True)
    archive.seek(0)
    try:
        with tarfile.open(fileobj=archive, mode="r:") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member)
            _extract_data(tar, destination, members)
    except tarfile.TarError as error:
        raise ProtocolError(f"the downloaded archive cannot be unpacked safely: {error}") from error
    if not members:
        raise ProtocolError("the downloaded archive is empty")
    # Names as stored; the filter strips a leading "/" when it extracts, so it is ignored here too.
    top = [part for part in PurePosixPath(members[0].name).parts if part not in ("/", ".")]
    return destination / top[0] if top else destination
