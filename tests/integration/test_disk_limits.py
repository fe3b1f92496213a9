"""The size cap on a sandbox's writable space (limits.disk_bytes): writing past it fails
with ENOSPC inside the sandbox, which keeps working; the host side never holds more than the cap;
other sandboxes are unaffected. Under each local launcher (bubblewrap and unshare), and for the
workspace of Apptainer sandboxes. The test looks only at its own daemons' sandbox directories."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.daemon import diskcap
from corral.daemon.backends.storage import StoragePool
from corral.sdk import Client, errors
from tests.conftest import SIF_TEST_IMAGE, DaemonProcess, require_backend, require_image

CAP = 32 << 20
# Writes 48 MiB into the sandbox's workspace (or the directory given): more than CAP.
FILL = "dd if=/dev/zero of={dir}/fill bs=1M count=48 2>&1; echo rc=$?"


@contextlib.contextmanager
def own_daemon(root: Path, config_text: str) -> Iterator[DaemonProcess]:
    """A daemon of this test's, with its configuration, stopped afterwards."""
    config = root / "corral.toml"
    config.write_text(config_text)
    proc = DaemonProcess(root, "--config", str(config)).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=("bwrap", "unshare"))
def disk_daemon(request, tmp_path_factory) -> Iterator[DaemonProcess]:
    require_backend("local")
    with own_daemon(tmp_path_factory.mktemp(f"disk-{request.param}"), f'[local]\nisolation = "{request.param}"\n') as d:
        yield d


@pytest.fixture
def client(disk_daemon) -> Iterator[Client]:
    with Client(disk_daemon.address) as c:
        yield c


def host_dir(daemon: DaemonProcess, sandbox_id: str) -> Path:
    """The sandbox's own directory on the host (its workspace and /tmp live there)."""
    return daemon.state_dir / "sandboxes" / sandbox_id


def host_bytes(path: Path) -> tuple[int, int]:
    """(size of the filesystem at `path`, bytes its files take) as the host sees them."""
    fs = os.statvfs(path)
    used = 0
    for parent, dirs, files in os.walk(path):
        # Not into the mounts of the sandbox's root (its image): only what lies on its own filesystem.
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(parent, d))]
        used += sum(os.lstat(os.path.join(parent, f)).st_blocks * 512 for f in files)
    return fs.f_blocks * fs.f_frsize, used


@pytest.mark.parametrize("where", ["/workspace", "/tmp"])
def test_writing_past_the_cap_is_enospc_and_the_sandbox_keeps_working(disk_daemon, client, where):
    with client.create_sandbox(disk_bytes=CAP) as sb:
        r = sb.exec(FILL.format(dir=where), timeout=60)
        assert b"No space left on device" in r.stdout, r.stdout
        assert b"rc=0" not in r.stdout
        size, used = host_bytes(host_dir(disk_daemon, sb.id))
        assert size <= CAP and used <= CAP, (size, used)
        # Still alive, and deleting gives the space back.
        assert sb.exec(["echo", "alive"], timeout=20).stdout == b"alive\n"
        assert sb.exec(f"rm {where}/fill && {FILL.format(dir=where).replace('48', '16')}", timeout=60).stdout.endswith(
            b"rc=0\n"
        )


def test_other_sandboxes_are_unaffected(client):
    with client.create_sandbox(disk_bytes=CAP) as full, client.create_sandbox(disk_bytes=CAP) as other:
        assert b"No space left on device" in full.exec(FILL.format(dir="/workspace"), timeout=60).stdout
        r = other.exec(FILL.format(dir="/workspace").replace("48", "16"), timeout=60)
        assert r.stdout.endswith(b"rc=0\n"), r.stdout
        # The daemon's own writes into the full sandbox fail cleanly; into the other one they work.
        with pytest.raises(errors.ResourceExhausted, match="No space left on device"):
            full.write_file("/workspace/note", b"x" * (1 << 20))
        other.write_file("/workspace/note", b"x" * 4096)
        assert other.read_file("/workspace/note") == b"x" * 4096


def test_limit_is_reported(disk_daemon, client):
    with client.create_sandbox(disk_bytes=CAP) as sb:
        assert sb.info.limits.disk_bytes == CAP
        disk = next(s for s in sb.info.limit_status if s.kind == "disk")
        assert disk.enforced and disk.mechanism, disk
    with client.create_sandbox() as sb:
        assert sb.info.limits.disk_bytes == 4 << 30  # the daemon's default (limits.disk_bytes)
        assert host_bytes(host_dir(disk_daemon, sb.id))[0] <= 4 << 30
    local = next(b for b in client.node_info().backends if b.backend == "local")
    assert next(s for s in local.limits if s.kind == "disk").enforced


@pytest.mark.parametrize("size", [1, (16 << 20) - 1, (1 << 44) + 1, 1 << 63])
def test_bad_sizes_are_invalid_argument(client, size):
    with pytest.raises(errors.InvalidArgument, match="limits.disk_bytes"):
        client.create_sandbox(disk_bytes=size)


def test_negative_size_is_invalid_argument(client):
    with pytest.raises(errors.InvalidArgument, match="disk_bytes"):
        client.create_sandbox(disk_bytes=-1)


def test_destroy_and_crash_leave_no_mount(tmp_path):
    require_backend("local")
    daemon = DaemonProcess(tmp_path).start()
    try:
        with Client(daemon.address) as c:
            gone = c.create_sandbox(disk_bytes=CAP)
            path = host_dir(daemon, gone.id)
            assert os.path.ismount(path)
            gone.destroy()
            assert not path.exists()
            crashed = host_dir(daemon, c.create_sandbox(disk_bytes=CAP).id)
            assert os.path.ismount(crashed)
        daemon.stop(signal.SIGKILL)
        daemon.start()  # reaps what the killed daemon left
        assert not os.path.ismount(crashed) and not crashed.exists()
    finally:
        daemon.stop()


@pytest.mark.parametrize("where", ["/workspace", "/usr/local"])  # the workspace, the image's overlay
def test_singularity_workspace_and_overlay_are_capped(tmp_path, where):
    require_backend("singularity")
    require_image("singularity")
    config = f'[daemon]\ndefault_backend = "singularity"\n[singularity]\ndefault_image = "{SIF_TEST_IMAGE}"\n'
    with own_daemon(tmp_path, config) as daemon, Client(daemon.address) as c, c.create_sandbox(disk_bytes=CAP) as sb:
        assert next(s for s in sb.info.limit_status if s.kind == "disk").enforced
        assert b"No space left on device" in sb.exec(FILL.format(dir=where), timeout=60).stdout
        assert host_bytes(host_dir(daemon, sb.id))[0] <= CAP
        assert sb.exec(["echo", "alive"], timeout=20).stdout == b"alive\n"


@pytest.mark.parametrize("kind", [diskcap.LOOP_EXT4, diskcap.TMPFS])
def test_each_kind_caps_and_unmounts(tmp_path, kind):
    """Both kinds of capped filesystem (the tmpfs one is what nodes without loop devices get)."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    target = tmp_path / "sandbox"
    target.mkdir()
    asyncio.run(diskcap.mount_capped(kind, target, CAP))
    try:
        assert os.listdir(target) == []
        with pytest.raises(OSError) as full, open(target / "fill", "wb") as fh:
            for _ in range(48):
                fh.write(b"\0" * (1 << 20))
                fh.flush()
                os.fsync(fh.fileno())
        assert full.value.errno == errno.ENOSPC
        assert host_bytes(target)[0] <= CAP
    finally:
        diskcap.unmount(target)
    assert not os.path.ismount(target) and os.listdir(target) == []


def test_every_backend_reports_disk(daemon):
    """Each backend case says whether disk is capped: Docker and Podman (docker.storage = "auto")
    with the btrfs pool where the node can have it, else saying why not, naming the engine's
    storage driver."""
    with Client(daemon.address) as c:
        backend = next(b for b in c.node_info().backends if b.backend == daemon.backend)
    disk = next(s for s in backend.limits if s.kind == "disk")
    if daemon.backend == "docker" and StoragePool(daemon.state_dir, 0).lacking():
        assert not disk.enforced and "storage driver" in disk.reason and "unknown" not in disk.reason, disk
    else:
        assert disk.enforced and disk.mechanism, disk


def test_no_cap_when_the_node_sets_none(tmp_path):
    """[limits] disk_bytes = 0: no filesystem of the sandbox's own, and its status says so."""
    require_backend("local")
    with own_daemon(tmp_path, "[limits]\ndisk_bytes = 0\n") as daemon, Client(daemon.address) as c:
        with c.create_sandbox() as sb:
            assert sb.info.limits.disk_bytes == 0
            disk = next(s for s in sb.info.limit_status if s.kind == "disk")
            assert not disk.enforced and "limits.disk_bytes is 0" in disk.reason, disk
            assert not os.path.ismount(host_dir(daemon, sb.id))
