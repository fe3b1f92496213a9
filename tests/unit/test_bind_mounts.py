"""CreateSandbox's host bind mounts, checked before any sandbox exists (daemon/mounts.py): only host
paths under the configured roots, judged after symlinks are resolved, and a path outside them is
refused before the daemon looks at it; sandbox paths clear of what the daemon reserves. And the
idmapped staging mounts container backends bind instead of the host paths
(daemon/backends/idmapped_binds.py), made and removed in this process (as root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from corral.daemon import mounts
from corral.daemon.backends import idmapped_binds
from corral.daemon.backends.base import BindMount
from corral.daemon.config import ConfigError, load_config
from corral.daemon.mounts import MAX_MOUNTS, MountRequest, bind_mounts
from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

WORKDIR = "/workspace"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An allowed root holding a directory, a file, and symlinks inside and out of it."""
    allowed = tmp_path / "allowed"
    (allowed / "data").mkdir(parents=True)
    (allowed / "data" / "file.txt").write_text("x")
    (allowed / "inside-link").symlink_to(allowed / "data")
    (tmp_path / "outside").mkdir()
    (allowed / "escape-link").symlink_to(tmp_path / "outside")
    return allowed


def check(requests: list[MountRequest], roots: list[str], protected: tuple[str, ...] = ()) -> tuple[BindMount, ...]:
    return bind_mounts(requests, roots=roots, protected=protected, workdir=WORKDIR)


def test_mounts_under_a_root_resolve_and_are_read_only_by_default(root: Path) -> None:
    result = check(
        [
            MountRequest(f"{root}/inside-link/", "/mnt/data/"),
            MountRequest(f"{root}/data/./file.txt", "/etc/task.txt", writable=True),
            MountRequest(str(root), "/mnt"),
        ],
        [str(root)],
    )
    # Ordered by sandbox path, so that /mnt comes before /mnt/data, which lies inside it.
    assert result == (
        BindMount(f"{root}/data/file.txt", "/etc/task.txt", read_only=False),
        BindMount(str(root), "/mnt", read_only=True),
        BindMount(f"{root}/data", "/mnt/data", read_only=True),
    )


def test_no_roots_refuses_every_mount(root: Path) -> None:
    with pytest.raises(PermissionDenied, match=r"allows no bind mounts \(its sandbox.bind_roots is empty\)"):
        check([MountRequest(f"{root}/data", "/data")], [])


def test_outside_the_roots_is_permission_denied_naming_them(root: Path, tmp_path: Path) -> None:
    for outside in ("/etc", f"{tmp_path}/outside", f"{root}/../outside", f"{root}-sibling"):
        with pytest.raises(PermissionDenied) as caught:
            check([MountRequest(outside, "/data")], [str(root)])
        assert f"only under {root} (sandbox.bind_roots)" in str(caught.value)


def test_a_symlink_leading_out_of_the_roots_is_permission_denied(root: Path) -> None:
    with pytest.raises(PermissionDenied, match="leads outside them"):
        check([MountRequest(f"{root}/escape-link", "/data")], [str(root)])


def test_outside_the_roots_says_nothing_of_whether_the_path_exists(root: Path, tmp_path: Path, monkeypatch) -> None:
    """The same answer for a host path that exists and one that does not, and no look at either."""
    looked_at: list[str] = []
    real_stat, real_realpath = os.stat, os.path.realpath

    def stat(path, *args, **kwargs):
        looked_at.append(str(path))
        return real_stat(path, *args, **kwargs)

    def realpath(path, *args, **kwargs):
        looked_at.append(str(path))
        return real_realpath(path, *args, **kwargs)

    monkeypatch.setattr(mounts.os, "stat", stat)
    monkeypatch.setattr(mounts.os.path, "realpath", realpath)
    messages = []
    for outside in (f"{tmp_path}/outside", f"{tmp_path}/missing"):
        looked_at.clear()
        with pytest.raises(PermissionDenied) as caught:
            check([MountRequest(outside, "/data")], [str(root)])
        messages.append(str(caught.value).replace(outside, "PATH"))
        assert looked_at == [str(root)]  # only the root was resolved
    assert messages[0] == messages[1]


def test_under_a_root_missing_is_not_found_and_a_special_file_invalid(root: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        check([MountRequest(f"{root}/missing", "/data")], [str(root)])
    os.mkfifo(root / "fifo")
    with pytest.raises(InvalidArgument, match="must be a directory or a regular file"):
        check([MountRequest(f"{root}/fifo", "/data")], [str(root)])


def test_the_daemons_own_files_are_refused_even_under_a_root(root: Path) -> None:
    state = root / "data" / "state"
    state.mkdir()
    for path in (str(state), f"{state}/x", f"{root}/data", str(root)):
        with pytest.raises(PermissionDenied, match="the daemon's own files"):
            check([MountRequest(path, "/data")], [str(root)], protected=(str(state),))


@pytest.mark.parametrize(
    ("sandbox_path", "message"),
    [
        ("data", "must be absolute"),
        ("/", "cannot cover the sandbox's root"),
        ("//", "cannot cover the sandbox's root"),
        ("/x/..", "cannot cover the sandbox's root"),
        ("/proc", "/proc"),
        ("/proc/self", "/proc"),
        ("/dev/shm", "/dev"),
        ("/sys/fs", "/sys"),
        ("/run", "/run/corral"),
        ("/run/corral/k1", "/run/corral"),
        ("/workspace", "/workspace"),
        ("/workspace/data", "/workspace"),
        ("/a\0b", "NUL"),
    ],
)
def test_bad_sandbox_paths_are_invalid_argument(root: Path, sandbox_path: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check([MountRequest(f"{root}/data", sandbox_path)], [str(root)])


def test_sandbox_paths_are_checked_before_host_paths(root: Path) -> None:
    """A malformed request is INVALID_ARGUMENT whatever its host path (no probing through it)."""
    with pytest.raises(InvalidArgument):
        check([MountRequest("/etc", "/proc/x")], [str(root)])


def test_duplicate_sandbox_paths_and_too_many_mounts_are_invalid(root: Path) -> None:
    with pytest.raises(InvalidArgument, match="same sandbox_path '/data'"):
        check([MountRequest(f"{root}/data", "/data"), MountRequest(str(root), "/data/")], [str(root)])
    many = [MountRequest(f"{root}/data", f"/m{i}") for i in range(MAX_MOUNTS + 1)]
    with pytest.raises(InvalidArgument, match=f"at most {MAX_MOUNTS} mounts"):
        check(many, [str(root)])
    assert len(check(many[:MAX_MOUNTS], [str(root)])) == MAX_MOUNTS


def test_a_relative_host_path_is_invalid(root: Path) -> None:
    with pytest.raises(InvalidArgument, match="host_path must be absolute"):
        check([MountRequest("data", "/data")], [str(root)])


def test_bind_roots_come_from_the_config_file_and_must_be_absolute(tmp_path: Path) -> None:
    path = tmp_path / "corral.toml"
    path.write_text('[sandbox]\nbind_roots = ["/data/corral", "/srv/tasks"]\n')
    assert load_config(path, environ={}).sandbox.bind_roots == ["/data/corral", "/srv/tasks"]
    assert load_config(environ={}).sandbox.bind_roots == []
    for bad in ('["relative"]', "[1]", '"/data"'):
        path.write_text(f"[sandbox]\nbind_roots = {bad}\n")
        with pytest.raises(ConfigError, match="sandbox.bind_roots"):
            load_config(path, environ={})


# -- idmapped staging mounts ------------------------------------------------------------------------

FIRST_ID = 5_000_000
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="idmapped mounts need root")


def test_shown_ids_are_the_blocks_read_backwards_and_nobody_outside_it() -> None:
    shown = idmapped_binds.shown_id
    assert [shown(FIRST_ID, FIRST_ID), shown(FIRST_ID + 65535, FIRST_ID)] == [0, 65535]
    assert [shown(0, FIRST_ID), shown(FIRST_ID - 1, FIRST_ID), shown(FIRST_ID + 65536, FIRST_ID)] == [65534] * 3


@as_root
def test_a_staging_mount_shows_the_host_path_through_the_sandboxs_ids(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    os.chown(host, FIRST_ID, FIRST_ID)
    (host / "root.txt").write_text("host root's")
    (host / "task.txt").write_text("task")
    staging = tmp_path / "state" / "binds" / "docker" / "sb-1"
    mounts = (BindMount(str(host), "/data", read_only=False), BindMount(str(host / "task.txt"), "/task.txt"))
    staged = idmapped_binds.stage(mounts, FIRST_ID, staging)
    try:
        assert staged == (
            BindMount(str(staging / "0"), "/data", read_only=False),
            BindMount(str(staging / "1"), "/task.txt", read_only=True),
        )
        # This process is host root, as root inside a container is: what it creates is the
        # block's first id's, host root's file is nobody's and out of its reach.
        (staging / "0" / "made").write_text("x")
        assert ((host / "made").stat().st_uid, (host / "made").stat().st_gid) == (FIRST_ID, FIRST_ID)
        assert os.stat(staging / "0" / "root.txt").st_uid == 65534
        assert (staging / "0" / "root.txt").read_text() == "host root's"
        with pytest.raises(PermissionError):
            (staging / "0" / "root.txt").write_text("changed")
        with pytest.raises(OSError, match="Read-only file system"):
            (staging / "1").write_text("changed")
    finally:
        idmapped_binds.unstage(staging)
    assert not staging.exists() and staging.parent.is_dir()
    assert sorted(p.name for p in host.iterdir()) == ["made", "root.txt", "task.txt"]
    assert (host / "task.txt").read_text() == "task" and (host / "root.txt").read_text() == "host root's"


@as_root
def test_a_restarted_daemon_unstages_what_was_left_without_deleting_through_it(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    (host / "kept.txt").write_text("kept")
    root = idmapped_binds.staging_root(tmp_path / "state", "singularity")
    for sandbox_id in ("sb-1", "sb-2"):
        idmapped_binds.stage((BindMount(str(host), "/data"),), FIRST_ID, root / sandbox_id)
    idmapped_binds.release_staging(tmp_path / "state", "singularity", {"sandbox_id": "sb-1"})
    idmapped_binds.release_staging(tmp_path / "state", "singularity", {"sandbox_id": ".."})  # ignored
    assert [p.name for p in root.iterdir()] == ["sb-2"]
    idmapped_binds.unstage_all(root)
    assert list(root.iterdir()) == []
    assert [p.name for p in host.iterdir()] == ["kept.txt"]


@as_root
def test_a_filesystem_that_cannot_be_idmapped_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    ramfs = tmp_path / "ramfs"
    ramfs.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "corral-test", str(ramfs)], check=True)
    try:
        staging = tmp_path / "state" / "binds" / "docker" / "sb-1"
        mounts = (BindMount(str(tmp_path), "/ok"), BindMount(str(ramfs), "/data", read_only=False))
        with pytest.raises(FailedPrecondition, match="does not support idmapped mounts"):
            idmapped_binds.stage(mounts, FIRST_ID, staging)
        assert not staging.exists()
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["umount", str(ramfs)], check=True)


@as_root
def test_a_mount_that_does_not_show_the_host_path_through_the_sandboxs_ids_is_refused(tmp_path: Path) -> None:
    # This process's own root stands in for a container's: the staging mount shows the host
    # directory through the ids, the host directory itself does not, an empty directory is another.
    host, other = tmp_path / "host", tmp_path / "other"
    host.mkdir()
    other.mkdir()
    staging = tmp_path / "state" / "binds" / "docker" / "sb-1"
    (staged,) = idmapped_binds.stage((BindMount(str(host), "/data"),), FIRST_ID, staging)
    try:
        idmapped_binds.check_shown((BindMount(str(host), staged.host_path),), FIRST_ID, os.getpid())
        for seen in (str(host), str(other)):
            with pytest.raises(FailedPrecondition, match="does not show .* through the sandbox's ids"):
                idmapped_binds.check_shown((BindMount(str(host), seen),), FIRST_ID, os.getpid())
        with pytest.raises(FailedPrecondition, match="is missing in the container"):
            idmapped_binds.check_shown((BindMount(str(host), str(tmp_path / "nowhere")),), FIRST_ID, os.getpid())
    finally:
        idmapped_binds.unstage(staging)
