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


def test_escaping_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError):
        extract_archive(malicious_archive("../escape.txt"), tmp_path / "out")
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


def archive_of(*members: tarfile.TarInfo, data: bytes = b"evil") -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info in members:
            if info.isreg():
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


@pytest.mark.parametrize("target", ["/usr/bin/python3", "../../../outside", "/etc/passwd"])
def test_symlinks_are_recreated_as_links_whatever_they_point_to(tmp_path: Path, target: str) -> None:
    """A venv's bin/python -> /usr/bin/python3 comes back as that link, not followed nor refused."""
    top = extract_archive(
        archive_of(
            member("venv", tarfile.DIRTYPE),
            member("venv/bin", tarfile.DIRTYPE),
            member("venv/bin/python", tarfile.SYMTYPE, target),
        ),
        tmp_path / "out",
    )
    assert os.readlink(top / "bin" / "python") == target


@pytest.mark.parametrize(
    "members",
    [
        # A link to a directory outside, then a file "inside" that link.
        [member("top", tarfile.DIRTYPE), member("top/link", tarfile.SYMTYPE, "{outside}"), member("top/link/evil.txt")],
        # The same through a relative link that climbs out.
        [member("top", tarfile.DIRTYPE), member("top/up", tarfile.SYMTYPE, "../.."), member("top/up/evil.txt")],
        # A directory member where the link is: must not be created (or entered) through it.
        [
            member("top/link", tarfile.SYMTYPE, "{outside}"),
            member("top/link", tarfile.DIRTYPE),
            member("top/link/evil.txt"),
        ],
    ],
)
def test_members_are_never_written_through_a_link(tmp_path: Path, members: list[tarfile.TarInfo]) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    for info in members:
        info.linkname = info.linkname.format(outside=outside)
    with pytest.raises(ProtocolError, match="not a directory|would replace"):
        extract_archive(archive_of(*members), tmp_path / "a" / "b")
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "evil.txt").exists()


def test_a_file_member_replaces_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"untouched")
    top = extract_archive(
        archive_of(member("top", tarfile.DIRTYPE), member("top/f", tarfile.SYMTYPE, str(outside)), member("top/f")),
        tmp_path / "out",
    )
    assert outside.read_bytes() == b"untouched"
    assert not (top / "f").is_symlink() and (top / "f").read_bytes() == b"evil"


def test_hard_links_must_stay_inside_the_archive(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError):
        extract_archive(archive_of(member("top/h", tarfile.LNKTYPE, "/etc/passwd")), tmp_path / "out")
    with pytest.raises(ProtocolError):
        extract_archive(archive_of(member("top/h", tarfile.LNKTYPE, "../x")), tmp_path / "out")
    # A hard link through a symlink the archive made is refused too.
    (tmp_path / "secret").write_bytes(b"s")
    with pytest.raises(ProtocolError):
        extract_archive(
            archive_of(
                member("top/l", tarfile.SYMTYPE, str(tmp_path)), member("top/h", tarfile.LNKTYPE, "top/l/secret")
            ),
            tmp_path / "out2",
        )


@pytest.mark.parametrize(
    "member",
    [
        {"name": "../evil.txt"},
        {"name": "/etc/evil"},
        {"name": "ok/fifo", "type": tarfile.FIFOTYPE},
        {"name": "ok/dev", "type": tarfile.CHRTYPE},
    ],
)
def test_unsafe_members_are_refused_before_extraction(tmp_path, member):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(member["name"])
        info.type = member.get("type", tarfile.REGTYPE)
        tar.addfile(info, io.BytesIO(b"") if info.type == tarfile.REGTYPE else None)
    with pytest.raises(ProtocolError):
        extract_archive(buf, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()
    assert not (tmp_path / "out" / "ok").exists()


def test_unpacking_drops_set_id_bits_and_foreign_owners(tmp_path: Path) -> None:
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


def test_zeros_become_holes_and_sparse_members_stay_sparse(tmp_path: Path) -> None:
    """A file sent as zeros (a tar without --sparse) and one sent as a GNU sparse member both
    arrive sparse, with the same bytes."""
    import subprocess

    source = tmp_path / "src"
    source.mkdir()
    with open(source / "sparse.bin", "wb") as f:
        f.truncate(256 << 20)
        f.seek(100 << 20)
        f.write(b"data in the middle")
    for flags in ([], ["--sparse"]):
        archive = subprocess.run(
            ["tar", *flags, "-c", "-f", "-", "-C", str(source), "sparse.bin"], capture_output=True, check=True
        ).stdout
        top = extract_archive(io.BytesIO(archive), tmp_path / f"out{len(flags)}")
        st = os.stat(top)
        assert st.st_size == 256 << 20 and st.st_blocks * 512 < 1 << 20, flags
        with open(top, "rb") as f:
            f.seek(100 << 20)
            assert f.read(18) == b"data in the middle"


def test_round_trip_either_way(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    top = unpack(list(tar_chunks(tree)), tmp_path / "out")
    assert (top / "big.bin").read_bytes() == (tree / "big.bin").read_bytes()
    assert os.readlink(top / "link") == "src/pkg/mod.py"
    assert os.stat(top / "run-again.sh").st_ino == os.stat(top / "run.sh").st_ino
