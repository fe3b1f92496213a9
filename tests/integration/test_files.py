"""File operations: byte-exact round trips, escapes rejected, tar upload and download."""

from __future__ import annotations

import os

import pytest

from corral.sdk import errors
from tests.conftest import ROOT_INSIDE


def test_round_trip_arbitrary_bytes(sandbox):
    data = bytes(range(256)) * 1000 + b"\x00\xff"
    sandbox.write_file("/workspace/deep/dir/blob.bin", data)
    assert sandbox.read_file("deep/dir/blob.bin") == data
    assert (
        sandbox.exec(["sha256sum", "deep/dir/blob.bin"], timeout=10).stdout.split()[0].decode()
        == __import__("hashlib").sha256(data).hexdigest()
    )
    assert sandbox.read_file("deep/dir/blob.bin", offset=256, limit=3) == b"\x00\x01\x02"


def test_written_files_belong_to_the_sandbox_user(sandbox):
    sandbox.write_file("owned.txt", b"x", mode=0o600)
    r = sandbox.exec("stat -c '%u %a' owned.txt; id -u", timeout=10).stdout.split()
    assert r[0] == r[2] and r[1] == b"600"


def test_list_dir(sandbox):
    sandbox.write_file("ls/a.txt", b"aa")
    sandbox.exec("mkdir ls/sub && ln -s a.txt ls/link", timeout=10).check()
    entries = {e.name: e for e in sandbox.list_dir("ls")}
    assert set(entries) == {"a.txt", "sub", "link"}
    assert entries["a.txt"].size_bytes == 2 and entries["sub"].type == "directory"
    assert entries["link"].type == "symlink" and entries["link"].symlink_target == "a.txt"


@pytest.mark.parametrize("path", ["../../../../etc/shadow", "/etc/shadow", "escape/../../../../etc/shadow"])
def test_escapes_and_privileged_reads_rejected(sandbox, backend, path):
    if backend in ROOT_INSIDE:
        # Root inside reads the image's own shadow file, never the host's.
        assert sandbox.read_file(path) == sandbox.exec(["cat", "/etc/shadow"], timeout=10).stdout
        return
    with pytest.raises((errors.PermissionDenied, errors.SandboxNotFound, errors.CorralError)) as info:
        sandbox.read_file(path)
    assert not isinstance(info.value, errors.Internal)


def test_symlink_cannot_escape(sandbox, backend, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)
    # An absolute symlink is resolved inside the sandbox's root, never the host's.
    sandbox.exec(f"ln -s {secret} link-out && ln -s ../../../../../../{secret} rel-out", timeout=10).check()
    for link in ("link-out", "rel-out"):
        try:
            data = sandbox.read_file(link)
        except errors.CorralError:
            continue
        assert data != b"host only"
    if backend in ROOT_INSIDE or backend == "local":  # root inside writes its own root filesystem
        sandbox.write_file("/usr/bin/evil", b"x")
        assert not os.path.exists("/usr/bin/evil")
        return
    with pytest.raises(errors.CorralError):
        sandbox.write_file("/etc/passwd-evil", b"x")
    with pytest.raises(errors.PermissionDenied):
        sandbox.write_file("/usr/bin/evil", b"x")


def test_upload_and_download_tar(sandbox, tmp_path):
    src = tmp_path / "project"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_bytes(b"print('hi')\n")
    (src / "data.bin").write_bytes(bytes(range(256)) * 4096)
    sandbox.upload(str(src), "/workspace/in")
    assert sandbox.exec(["python3", "in/project/pkg/mod.py"], timeout=30).stdout == b"hi\n"
    out = tmp_path / "back"
    out.mkdir()
    sandbox.download("/workspace/in/project", str(out))
    assert (out / "project" / "data.bin").read_bytes() == (src / "data.bin").read_bytes()
    assert (out / "project" / "pkg" / "mod.py").read_bytes() == b"print('hi')\n"


def test_fifo_is_refused_without_blocking(sandbox):
    sandbox.exec("mkfifo /workspace/pipe", timeout=10).check()
    for _ in range(20):  # more than the daemon has file threads: none may stay parked
        with pytest.raises(errors.InvalidArgument, match="not a regular file"):
            sandbox.read_file("pipe")
    with pytest.raises(errors.InvalidArgument, match="not a regular file"):
        sandbox.write_file("pipe", b"x")
    sandbox.write_file("still-works.txt", b"ok")
    assert sandbox.read_file("still-works.txt") == b"ok"
