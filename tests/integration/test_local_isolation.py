"""What a local sandbox sees of the host and how it survives its own processes and a daemon crash,
under each launcher (bubblewrap and unshare). Every host path here is one the test makes and
removes itself."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.sdk import Client, errors
from tests.conftest import ROOTLESS_HERE, DaemonProcess, alive_pids, require_backend, sandbox_pids
from tests.integration.local_images import make_rootfs

# A root daemon's local backend (its id blocks, mounts and launchers): rootless is another mode.
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason=ROOTLESS_HERE)

LAUNCHERS = ("bwrap", "unshare")


@contextlib.contextmanager
def host_dir(parent: str, mode: int = 0o755, name: str = "corral-test-") -> Iterator[Path]:
    """A fresh directory of this test's under `parent`, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=name, dir=parent))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def bind_mount(src: Path | str, dst: Path) -> Iterator[None]:
    """A bind mount of this test's own (on a directory it made), removed afterwards."""
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(dst)], check=False)


def start_daemon(root: Path, launcher: str, local_settings: str = "") -> DaemonProcess:
    require_backend("local")
    config = root / "corral.toml"
    config.write_text(f'[local]\nisolation = "{launcher}"\n{local_settings}')
    return DaemonProcess(root, "--config", str(config)).start()


@pytest.fixture(scope="module")
def shared_dirs() -> Iterator[dict[str, Path]]:
    """Host directories the module's daemons are told about (local.host_paths) or not: an allowed
    one, an allowed one with a space in its name whose writable subdirectory is a mount of its own,
    and data directories under /srv, /opt and /root that nothing allows."""
    with contextlib.ExitStack() as stack:
        allowed = stack.enter_context(host_dir("/srv"))
        (allowed / "shared.txt").write_text("shared\n")
        spaced = stack.enter_context(host_dir("/srv", name="corral test "))
        writable = spaced / "mnt point"
        writable.mkdir(mode=0o777)
        writable.chmod(0o777)  # writable by the sandbox's uid on the host: only the mount may stop it
        stack.enter_context(bind_mount(writable, writable))
        # Under /tmp, which every sandbox has of its own: shown over it all the same.
        under_tmp = stack.enter_context(host_dir("/tmp"))
        (under_tmp / "tmp-shared.txt").write_text("shared from /tmp\n")
        dirs = {"allowed": allowed, "spaced": spaced, "writable": writable, "under_tmp": under_tmp}
        for parent in ("/srv", "/opt", "/root"):
            private = stack.enter_context(host_dir(parent))
            (private / "data.txt").write_text("host data\n")
            (private / "data.txt").chmod(0o644)
            dirs[parent] = private
        yield dirs


@pytest.fixture(scope="module", params=LAUNCHERS)
def launcher_daemon(request, shared_dirs, tmp_path_factory) -> Iterator[DaemonProcess]:
    host_paths = json.dumps([str(shared_dirs[name]) for name in ("allowed", "spaced", "under_tmp")])
    d = start_daemon(tmp_path_factory.mktemp(f"local-{request.param}"), request.param, f"host_paths = {host_paths}\n")
    yield d
    d.stop()


@pytest.fixture
def sb(launcher_daemon):
    with Client(launcher_daemon.address) as c, c.create_sandbox(image="host") as sandbox:
        yield sandbox


# -- what the sandbox sees ---------------------------------------------------------------------------


def test_host_image_shows_the_os_but_no_host_data(sb, shared_dirs):
    for parent in ("/srv", "/opt", "/root"):
        path = shared_dirs[parent] / "data.txt"
        r = sb.exec(["cat", str(path)], timeout=10)
        assert r.exit_code != 0 and b"host data" not in r.stdout, f"{path} is visible in the sandbox"
    r = sb.exec("ls / ; cat /etc/os-release >/dev/null && python3 -c 'print(1)'", timeout=20)
    assert r.exit_code == 0, r.stderr
    assert set(r.stdout.decode().split()) - {"1"} <= {
        *("bin", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "usr"),  # the operating system
        *("dev", "proc", "run", "tmp", "workspace", "srv"),  # the sandbox's own; /srv: host_paths
        "root",  # root's home, the sandbox's own and empty (the host's data.txt is not there: above)
    }
    assert sb.exec("ls -A /root", timeout=10).stdout == b""


def test_host_paths_are_shown_read_only(sb, shared_dirs):
    shared = shared_dirs["allowed"] / "shared.txt"
    assert sb.exec(["cat", str(shared)], timeout=10).stdout == b"shared\n"
    # A host mount below an allowed path, with spaces in its path, writable on the host by
    # permission bits: read-only in the sandbox like the rest.
    target = shared_dirs["writable"] / "probe"
    r = sb.exec(["touch", str(target)], timeout=10)
    assert r.exit_code != 0 and b"Read-only file system" in r.stderr, (r.exit_code, r.stderr)
    assert not target.exists()


def test_host_paths_under_tmp_are_shown_over_the_sandboxs_own_tmp(sb, shared_dirs):
    """/tmp is the sandbox's own, mounted over its root: a host path listed under it is mounted
    after, read-only, and the rest of /tmp stays the sandbox's (a venv or checkout in /tmp, as on
    CI machines, can be shown to host sandboxes)."""
    shown = shared_dirs["under_tmp"]
    assert sb.exec(["cat", str(shown / "tmp-shared.txt")], timeout=10).stdout == b"shared from /tmp\n"
    r = sb.exec(["touch", str(shown / "probe")], timeout=10)
    assert r.exit_code != 0 and b"Read-only file system" in r.stderr, (r.exit_code, r.stderr)
    own = f"/tmp/{sb.id}-own"
    sb.exec(["touch", own], timeout=10).check()
    assert not Path(own).exists()  # written in the sandbox's /tmp, not the host's


def test_writable_mounts_are_nosuid_nodev(sb):
    r = sb.exec(["cat", "/proc/self/mounts"], timeout=10)
    options = {fields[1]: fields[3].split(",") for fields in (line.split() for line in r.stdout.decode().splitlines())}
    for path in ("/workspace", "/tmp", "/run/corral", "/dev/shm"):
        assert {"nosuid", "nodev"} <= set(options[path]), (path, options[path])


def test_multiprocessing_has_a_writable_dev_shm(sb):
    code = "import multiprocessing as m; m.Lock(); print(m.Pool(2).map(abs, [-1]))"
    r = sb.exec(["python3", "-c", code], timeout=60)
    assert r.exit_code == 0 and r.stdout == b"[1]\n", r.stderr


def test_kill_all_inside_leaves_the_sandbox_working(sb):
    sb.exec("sleep 300 >/dev/null 2>&1 &", timeout=10).check()
    sb.exec("kill -9 -1", timeout=10)  # every process the sandbox's uid may signal
    for _ in range(3):
        assert sb.exec(["echo", "alive"], timeout=10).stdout == b"alive\n"
    assert sb.read_file("/etc/hostname") is not None  # file access through the init's root too


# -- directory images -----------------------------------------------------------------------------


@contextlib.contextmanager
def rootfs_image(parent: Path) -> Iterator[Path]:
    """A directory image under `parent` (tests/integration/local_images.py) with a data file any
    user may read and one only root may."""
    image = make_rootfs(parent / "image")
    (image / "data").mkdir(mode=0o755)
    (image / "data" / "readable.txt").write_text("image data\n")
    (image / "data" / "readable.txt").chmod(0o644)
    (image / "data" / "root-only.txt").write_text("root only\n")
    (image / "data" / "root-only.txt").chmod(0o600)
    yield image


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_directory_image_needs_what_the_sandbox_uid_could_read(launcher, tmp_path):
    d = start_daemon(tmp_path, launcher)
    try:
        with Client(d.address) as c:
            # Below a directory only root may enter: the sandbox's uid could not read the image on
            # the host, so it may not through the sandbox either.
            with host_dir("/srv", 0o700) as hidden, rootfs_image(hidden) as image:
                with pytest.raises(errors.FailedPrecondition, match="not readable by the sandbox's uid"):
                    c.create_sandbox(image=str(image))
            # The same image where anyone may reach it works; its root-only files are root's inside
            # (the sandbox's root), no other user's.
            with host_dir("/srv", 0o755) as public, rootfs_image(public) as image:
                with c.create_sandbox(image=str(image)) as sandbox:
                    assert sandbox.exec(["cat", "/data/readable.txt"], timeout=10).stdout == b"image data\n"
                    assert sandbox.exec(["cat", "/data/root-only.txt"], timeout=10).stdout == b"root only\n"
                    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
                    r = sandbox.exec([*as_nobody, "cat", "/data/root-only.txt"], timeout=10)
                    assert r.exit_code != 0 and b"Permission denied" in r.stderr
    finally:
        d.stop()


# -- a daemon crash ---------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sandbox_processes_end_soon_after_the_daemon_is_killed(launcher, tmp_path):
    d = start_daemon(tmp_path, launcher)
    try:
        with Client(d.address) as c:
            daemon_id = c.node_info().daemon_id
            sandbox = c.create_sandbox(image="host")
            sandbox.exec("setsid sleep 1001 >/dev/null 2>&1 & sleep 1002 >/dev/null 2>&1 &", timeout=10).check()
            # ... and tries to outlive the daemon by stopping every process it may signal (init
            # among them, were it the sandbox's uid's).
            sandbox.exec("kill -STOP -1", timeout=10)
        pids = sandbox_pids(daemon_id)
        assert len(pids) >= 3  # init and the two sleeps at least
        d.stop(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive_pids(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive_pids(pids), f"still running 10 s after the daemon died: {sorted(alive_pids(pids))}"
    finally:
        if d.proc and d.proc.poll() is not None:
            d.start()  # reaps the crashed daemon's records, cgroups and directories
        d.stop()
