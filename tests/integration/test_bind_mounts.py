"""CreateSandbox's host bind mounts through the API on every backend: a daemon whose
`sandbox.bind_roots` allows one directory; read-only unless asked, writable ones show the sandbox's
files on the host, nothing outside the roots, and the host directory unchanged by a read-only
mount. Files on a bind mount are seen through the sandbox's block of host ids on every backend:
what it writes belongs to its ids on the host, never to host root. (The checks of the paths
themselves: tests/unit/test_bind_mounts.py.)"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from corral.sdk import Client, Mount, errors
from tests.conftest import BACKEND_CASES, DaemonProcess, require_backend, require_image


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_mode}:{st.st_uid}".encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


# The daemon's first block of host ids: its first sandbox's root is UID_BASE on the host, the
# second's UID_BASE + BLOCK (a fresh daemon hands blocks out in order).
UID_BASE, BLOCK = 5_000_000, 65536
NOBODY = 65534


def mounts_under(path: Path) -> list[tuple[str, str]]:
    """(mount point, its options) of this process's mounts that lie under `path` (the test's own),
    but the daemon's btrfs pool (`<state_dir>/storage`: the docker backend's, mounted from its
    first container until the daemon stops, no sandbox's)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")
        if point.startswith(f"{path}/") and not point.endswith("/state/storage"):
            found.append((point, fields[5]))
    return found


def owned_dir(path: Path, owner: int, mode: int = 0o777) -> Path:
    path.mkdir()
    os.chown(path, owner, owner)
    path.chmod(mode)
    return path


@pytest.fixture(params=list(BACKEND_CASES))
def bind_daemon(request, tmp_path):
    requirement, backend, case_config = BACKEND_CASES[request.param]
    require_backend(requirement)
    require_image(requirement)
    roots = tmp_path / "roots"
    roots.mkdir()
    config = tmp_path / "corral.toml"
    config.write_text(f'{case_config}\n[sandbox]\nbind_roots = ["{roots}"]\nuid_base = {UID_BASE}\n')
    (tmp_path / "daemon").mkdir()  # apart from the roots: a root holding the daemon's files is refused
    daemon = DaemonProcess(tmp_path / "daemon", "--config", str(config)).start()
    try:
        yield daemon, roots, backend
    finally:
        daemon.stop()


def test_bind_mounts_are_read_only_unless_asked_and_only_under_the_roots(bind_daemon, tmp_path):
    daemon, roots, backend = bind_daemon
    shared = roots / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("host data\n")
    scratch = owned_dir(roots / "scratch", UID_BASE, 0o755)  # the first sandbox's root's
    before = digest(shared)
    mounts = [Mount(str(shared), "/mnt/shared"), Mount(str(scratch), "/data/scratch", writable=True)]
    with Client(daemon.address) as client:
        with client.create_sandbox(mounts=mounts, timeout=120) as sandbox:
            r = sandbox.exec("cat /mnt/shared/data.txt && touch /data/scratch/made && echo made", timeout=30)
            assert r.stdout == b"host data\nmade\n", r.stderr
            hostile = sandbox.exec(
                "echo x > /mnt/shared/data.txt; rm -f /mnt/shared/data.txt; touch /mnt/shared/new; "
                "chmod 777 /mnt/shared; mount -o remount,rw /mnt/shared; echo done",
                timeout=30,
            )
            assert hostile.stdout == b"done\n"
            assert sandbox.exec("cat /mnt/shared/data.txt", timeout=30).stdout == b"host data\n"
            assert [(m.host_path, m.sandbox_path, m.writable) for m in sandbox.info.mounts] == [
                (str(scratch), "/data/scratch", True),
                (str(shared), "/mnt/shared", False),
            ]
        assert digest(shared) == before
        # Root inside is the first id of the sandbox's unprivileged host id block, on every backend.
        assert ((scratch / "made").stat().st_uid, (scratch / "made").stat().st_gid) == (UID_BASE, UID_BASE)
        outside = tmp_path / "outside"
        outside.mkdir()
        with pytest.raises(errors.PermissionDenied):
            client.create_sandbox(mounts=[Mount(str(outside), "/mnt/x")], timeout=60)
        assert client.list_sandboxes() == []


def test_files_on_bind_mounts_belong_to_the_sandboxs_own_host_ids(bind_daemon, tmp_path):
    daemon, roots, backend = bind_daemon
    first, second = owned_dir(roots / "first", UID_BASE), owned_dir(roots / "second", UID_BASE + BLOCK)
    # Host root's files and directory, readable by all: the sandbox's root can read, never change them.
    host_dir = owned_dir(first / "host", 0, 0o755)
    host_root = host_dir / "host-root.txt"
    host_root.write_text("host root's\n")
    host_root.chmod(0o644)
    (first / "user-1000.txt").write_text("inside user 1000's\n")
    os.chown(first / "user-1000.txt", UID_BASE + 1000, UID_BASE + 1000)
    (first / "user-1000.txt").chmod(0o600)
    with Client(daemon.address) as client:
        a = client.create_sandbox(mounts=[Mount(str(first), "/data", writable=True)], timeout=120)
        b = client.create_sandbox(
            mounts=[Mount(str(second), "/data", writable=True), Mount(str(host_root), "/etc/task.txt")], timeout=120
        )
        with a, b:
            r = a.exec(
                "id -u; touch /data/by-root; stat -c %u:%g /data/by-root /data/host /data/host/host-root.txt "
                "/data/user-1000.txt; cat /data/user-1000.txt /data/host/host-root.txt; cd /data/host; "
                "for change in 'echo changed >> host-root.txt' 'chmod 666 host-root.txt' 'chown 0 host-root.txt' "
                "'rm -f host-root.txt' 'touch new' 'chmod 777 .'; do sh -c \"$change\" 2>/dev/null || echo refused; done",
                timeout=30,
            )
            assert r.stdout == (
                b"0\n0:0\n65534:65534\n65534:65534\n1000:1000\ninside user 1000's\nhost root's\n" + b"refused\n" * 6
            ), r
            r = a.exec("touch /data/by-1000 && echo ok", user="1000", timeout=30)
            assert r.stdout == b"ok\n", r.stderr
            r = b.exec("touch /data/by-root && stat -c %u /etc/task.txt && cat /etc/task.txt", timeout=30)
            assert r.stdout == b"65534\nhost root's\n", r
            if backend == "docker":
                # The engine binds a staging mount of the daemon's, idmapped, under its state directory.
                staged = mounts_under(daemon.state_dir / "binds")
                assert len(staged) == 3 and all("idmapped" in options.split(",") for _, options in staged), staged
        owners = {
            name: ((path).stat().st_uid, path.stat().st_gid)
            for name, path in (
                ("a root", first / "by-root"),
                ("a 1000", first / "by-1000"),
                ("b root", second / "by-root"),
            )
        }
        assert owners == {
            "a root": (UID_BASE, UID_BASE),
            "a 1000": (UID_BASE + 1000, UID_BASE + 1000),
            "b root": (UID_BASE + BLOCK, UID_BASE + BLOCK),
        }
        assert [p.name for p in host_dir.iterdir()] == ["host-root.txt"]
        assert host_root.read_text() == "host root's\n" and host_root.stat().st_mode & 0o777 == 0o644
        assert host_dir.stat().st_mode & 0o777 == 0o755
        assert mounts_under(tmp_path) == []


def test_a_restarted_daemon_removes_what_a_killed_one_left_on_bind_mounts(bind_daemon, tmp_path):
    daemon, roots, backend = bind_daemon
    data = owned_dir(roots / "data", UID_BASE)
    (data / "kept.txt").write_text("host file\n")
    with Client(daemon.address) as client:
        sandbox = client.create_sandbox(mounts=[Mount(str(data), "/data", writable=True)], timeout=120)
        assert sandbox.exec("touch /data/new && echo ok", timeout=30).stdout == b"ok\n"
    assert mounts_under(tmp_path)  # the sandbox's (a staging mount, or its root)
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with Client(daemon.address) as client:
        assert client.list_sandboxes() == []
    assert mounts_under(tmp_path) == []
    # Nothing was removed through a mount: the host directory keeps its files.
    assert sorted(p.name for p in data.iterdir()) == ["kept.txt", "new"]


def test_a_host_path_that_cannot_be_idmapped_is_refused_on_container_backends(bind_daemon):
    daemon, roots, backend = bind_daemon
    if backend != "docker":
        pytest.skip(f"{backend} sandboxes bind host paths into their user namespace, without an idmapped mount")
    ramfs = roots / "ramfs"  # a filesystem the kernel cannot idmap
    ramfs.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "corral-test", str(ramfs)], check=True)
    try:
        with Client(daemon.address) as client:
            with pytest.raises(errors.FailedPrecondition, match="does not support idmapped mounts"):
                client.create_sandbox(mounts=[Mount(str(ramfs), "/data", writable=True)], timeout=120)
            assert client.list_sandboxes() == []
        assert mounts_under(daemon.state_dir) == []
    finally:
        subprocess.run(["umount", str(ramfs)], check=False)
