"""Upload packing and download unpacking, on local files only."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from corral.sdk._archive import archive_name, extract_archive, tar_chunks
from corral.sdk.errors import InvalidArgument, ProtocolError


def make_tree(root: Path) -> Path:
    tree = root / "project"
    (tree / "src" / "pkg").mkdir(parents=True)
    (tree / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (tree / "empty").mkdir()
    (tree / "big.bin").write_bytes(os.urandom(300_000))
    (tree / "run.sh").write_text("#!/bin/sh\necho run\n")
    (tree / "run.sh").chmod(0o755)
    (tree / "link").symlink_to("src/pkg/mod.py")
    os.link(tree / "run.sh", tree / "run-again.sh")
    (tree / "ünï cödé.txt").write_text("unicode name")
    return tree


def unpack(chunks: list[bytes], into: Path) -> Path:
    return extract_archive(io.BytesIO(b"".join(chunks)), into)


def test_round_trip_of_a_directory(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    chunks = list(tar_chunks(tree, chunk_bytes=64 * 1024))
    top = unpack(chunks, tmp_path / "out")
    assert top == tmp_path / "out" / "project"
    for relative in ["src/pkg/mod.py", "big.bin", "run.sh", "run-again.sh", "ünï cödé.txt"]:
        assert (top / relative).read_bytes() == (tree / relative).read_bytes(), relative
    assert (top / "empty").is_dir()
    assert os.readlink(top / "link") == "src/pkg/mod.py"
    assert os.stat(top / "run.sh").st_mode & 0o777 == 0o755


def test_chunks_are_bounded(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    chunks = list(tar_chunks(tree, chunk_bytes=10_000))
    assert all(len(chunk) <= 10_000 for chunk in chunks)
    assert all(len(chunk) == 10_000 for chunk in chunks[:-1])
    assert sum(map(len, chunks)) % tarfile.BLOCKSIZE == 0


def test_hard_links_are_stored_once(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    with tarfile.open(fileobj=io.BytesIO(b"".join(tar_chunks(tree))), mode="r:") as tar:
        members = {member.name: member for member in tar.getmembers()}
    assert members["project/run-again.sh"].islnk() != members["project/run.sh"].islnk()
    assert members["project/link"].issym()
    assert list(members)[0] == "project"


def test_single_file(tmp_path: Path) -> None:
    source = tmp_path / "data.json"
    source.write_text('{"a": 1}')
    top = unpack(list(tar_chunks(source)), tmp_path / "out")
    assert top == tmp_path / "out" / "data.json"
    assert top.read_text() == '{"a": 1}'


def test_symlinked_root_is_followed(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    alias = tmp_path / "alias"
    alias.symlink_to(tree)
    top = unpack(list(tar_chunks(alias)), tmp_path / "out")
    assert top == tmp_path / "out" / "alias"
    assert (top / "src" / "pkg" / "mod.py").is_file()


def test_empty_file_and_exact_block_sizes(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "empty").write_bytes(b"")
    (tree / "block").write_bytes(b"x" * tarfile.BLOCKSIZE)
    top = unpack(list(tar_chunks(tree, chunk_bytes=tarfile.BLOCKSIZE)), tmp_path / "out")
    assert (top / "empty").read_bytes() == b""
    assert (top / "block").read_bytes() == b"x" * tarfile.BLOCKSIZE


def test_missing_path_fails_before_any_chunk(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        tar_chunks(tmp_path / "nope")


def test_archive_name() -> None:
    assert archive_name("/a/b/c.txt") == "c.txt"
    assert archive_name("/a/b/dir/") == "dir"
    with pytest.raises(InvalidArgument):
        archive_name("/")


def malicious_archive(name: str, *, symlink_to: str | None = None) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        if symlink_to is not None:
            info.type, info.linkname = tarfile.SYMTYPE, symlink_to
            tar.addfile(info)
        else:
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    return buffer


@pytest.mark.parametrize(
    ("name", "symlink_to"),
    [
        ("../escape.txt", None),
        ("link", "/etc/passwd"),
        ("link", "../../outside"),
    ],
)
def test_unsafe_archives_are_refused(tmp_path: Path, name: str, symlink_to: str | None) -> None:
    with pytest.raises(ProtocolError):
        extract_archive(malicious_archive(name, symlink_to=symlink_to), tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_absolute_names_are_refused(tmp_path: Path) -> None:
    """The daemon never sends absolute names, so an archive with one is refused whole."""
    outside = tmp_path / "absolute.txt"
    with pytest.raises(ProtocolError):
        extract_archive(malicious_archive(str(outside)), tmp_path / "out")
    assert not outside.exists()


def test_garbage_is_a_protocol_error(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError):
        extract_archive(io.BytesIO(b"not a tar archive" * 100), tmp_path / "out")


@pytest.mark.parametrize(
    "member",
    [
        {"name": "../evil.txt"},
        {"name": "/etc/evil"},
        {"name": "ok/link", "type": tarfile.SYMTYPE, "linkname": "../../outside"},
        {"name": "ok/abs", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"},
        {"name": "ok/fifo", "type": tarfile.FIFOTYPE},
    ],
)
def test_unsafe_members_are_refused_before_extraction(tmp_path, member):
    import io

    from corral.sdk._archive import extract_archive
    from corral.sdk.errors import ProtocolError

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(member["name"])
        info.type = member.get("type", tarfile.REGTYPE)
        info.linkname = member.get("linkname", "")
        tar.addfile(info, io.BytesIO(b"") if info.type == tarfile.REGTYPE else None)
    with pytest.raises(ProtocolError):
        extract_archive(buf, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()


@pytest.fixture(params=["data filter", "no extraction filters"])
def extraction(request, monkeypatch):
    """Both ways archives are unpacked: with tarfile's "data" filter, and as on a Python that
    predates extraction filters (before 3.11.4, such as Debian 12's python3)."""
    if request.param == "no extraction filters":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    return request.param


def test_unpacking_drops_set_id_bits_and_foreign_owners(tmp_path: Path, extraction: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, mode in (("top/suid", 0o4777), ("top/plain", 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid, info.uname = 2, mode, 4242, 4242, "nobody-here"
            tar.addfile(info, io.BytesIO(b"ok"))
    top = extract_archive(buffer, tmp_path / "out")
    suid = os.stat(top / "suid")
    assert suid.st_mode & 0o7777 == 0o755  # no set-uid, no group/other write
    assert os.stat(top / "plain").st_mode & 0o777 == 0o644
    assert (suid.st_uid, suid.st_gid) == (os.getuid(), os.getgid())
    assert (top / "suid").read_bytes() == b"ok"


def test_round_trip_either_way(tmp_path: Path, extraction: str) -> None:
    tree = make_tree(tmp_path)
    top = unpack(list(tar_chunks(tree)), tmp_path / "out")
    assert (top / "big.bin").read_bytes() == (tree / "big.bin").read_bytes()
    assert os.readlink(top / "link") == "src/pkg/mod.py"
    with pytest.raises(ProtocolError):
        extract_archive(malicious_archive("../escape.txt"), tmp_path / "out2")
