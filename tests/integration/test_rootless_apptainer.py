"""The Apptainer backend of a daemon that is not root (docs/backends.md, "Apptainer / Singularity",
"Without root"): a real `corral serve` run as an unprivileged user (test_rootless.py's helpers),
driven through the SDK on the test SIF image.

They skip, naming the reason, where Apptainer, the test image or an unprivileged user namespace is
missing. Every process they look for on the host carries a marker of their own in its command line."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.conftest import SIF_TEST_IMAGE, DaemonProcess
from tests.integration.rootless_daemons import (
    RootlessDaemon,
    as_user,
    marked,
    rootless_place,
    run_harness_in_a_sandbox,
    runs,
    wait_gone,
)

BACKEND = "singularity"


def _require_apptainer(user) -> None:
    binary = shutil.which("apptainer") or shutil.which("singularity")
    if binary is None:
        pytest.skip("neither apptainer nor singularity is installed")
    if not os.path.isfile(SIF_TEST_IMAGE):
        pytest.skip(f"no test SIF image at {SIF_TEST_IMAGE} (scripts/build_test_images.sh builds it)")
    made = runs(user, "unshare", "--user", "--map-root-user", "true")
    if made.returncode != 0:
        pytest.skip(f"this kernel refuses {user.pw_name} an unprivileged user namespace: {made.stderr.strip()}")


@pytest.fixture(scope="module")
def rootless() -> Iterator[RootlessDaemon]:
    with rootless_place(_require_apptainer) as place:
        yield place


@pytest.fixture(scope="module")
def rootless_daemon(rootless) -> Iterator[DaemonProcess]:
    with rootless.running("shared") as daemon:
        yield daemon


@pytest.fixture
def client(rootless_daemon):
    from corral.sdk import Client

    with Client(rootless_daemon.address) as c:
        yield c


def _sandbox(client):
    # (The first create unpacks the SIF for the daemon's user: seconds, more under load.)
    return client.create_sandbox(image=SIF_TEST_IMAGE, backend=BACKEND, timeout=300)


def test_a_sandbox_with_network_is_entered_on_the_hosts_network(client):
    """network=True: Apptainer leaves the sandbox on the host's network namespace, which an
    unprivileged daemon may not join (nor needs to): commands and shells still enter."""
    with client.create_sandbox(image=SIF_TEST_IMAGE, backend=BACKEND, network=True, timeout=300) as sb:
        r = sb.exec(["sh", "-c", "readlink /proc/self/ns/net"], timeout=30)
        assert r.exit_code == 0 and r.stdout.strip() == os.readlink("/proc/self/ns/net").encode(), r
        assert sb.shell("net").run("echo in-shell", timeout=30).output == b"in-shell\n"


def test_a_harness_in_a_sandbox_reaches_the_gateway_and_nothing_else(client):
    from corral.v1 import sandbox_pb2

    run_harness_in_a_sandbox(client, backend=sandbox_pb2.BACKEND_SINGULARITY, image=SIF_TEST_IMAGE)


def test_node_info_and_doctor_say_rootless(client, rootless):
    info = client.node_info()
    assert info.rootless
    status = next(b for b in info.backends if b.backend == BACKEND)
    assert status.available, status.detail
    assert "ROOTLESS" in status.detail and "--fakeroot" in status.detail
    limits = {limit.kind: limit for limit in status.limits}
    assert not limits["disk"].enforced and "not root" in limits["disk"].reason
    assert limits["network"].enforced
    for kind in ("memory", "pids", "cpu"):
        assert limits[kind].enforced == ("cgroup" in limits[kind].mechanism), limits[kind]
    env = ["env", f"HOME={rootless.root}", f"PYTHONPATH={rootless.boot}"]
    doctor = subprocess.run(
        [*as_user(rootless.user), *env, rootless.python, "-m", "corral.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next((x for x in doctor.stdout.splitlines() if x.strip().startswith(f"{BACKEND}:")), "")
    assert "available" in line and "not available" not in line and "ROOTLESS" in line, doctor.stdout


def test_lifecycle_exec_shell_files_kernel(client, rootless_daemon):
    sandbox_dirs = rootless_daemon.state_dir / "sandboxes"
    with _sandbox(client) as sb:
        r = sb.exec(["id", "-u"], timeout=30)
        assert (r.exit_code, r.stdout) == (0, b"0\n"), r
        # Root inside owns the image's files (a copy of the daemon's user), the host's stay unchanged.
        r = sb.exec("echo x >> /usr/bin/corral-probe && mkdir /testbed && echo ok", timeout=30)
        assert r.stdout == b"ok\n", r
        # Only loopback: --net --network none works unprivileged.
        assert sb.exec("cat /proc/net/dev | grep -c :", timeout=30).stdout == b"1\n"
        sb.write_file("data/a.txt", b"payload\n")
        assert sb.read_file("/workspace/data/a.txt") == b"payload\n"
        assert sb.exec("cat data/a.txt", timeout=30).stdout == b"payload\n"
        sb.write_file("/etc/corral-probe", b"in the overlay\n")
        assert sb.exec("cat /etc/corral-probe", timeout=30).stdout == b"in the overlay\n"
        shell = sb.shell("main")
        shell.run("cd /tmp && export X=41")
        turn = shell.run("echo $((X + 1)); pwd", timeout=30)
        assert turn.output == b"42\n/tmp\n"
        kernel = sb.kernel()
        kernel.execute("x = 21")
        assert kernel.execute("x * 2").result_text == "42"
        assert list(sandbox_dirs.iterdir())
    assert not list(sandbox_dirs.iterdir()), "destroy left the sandbox's directory"


def test_only_root_inside(client):
    from corral.sdk.errors import FailedPrecondition

    with _sandbox(client) as sb, pytest.raises(FailedPrecondition, match="only root"):
        sb.exec(["id"], user="nobody", timeout=30)


def test_two_sandboxes_cannot_see_each_other(client):
    marker = f"corral-rootless-{secrets.token_hex(4)}"
    with _sandbox(client) as a, _sandbox(client) as b:
        a.write_file(f"/workspace/{marker}", b"a's\n")
        assert a.exec(f"echo a > /tmp/{marker} && touch /usr/{marker}", timeout=30).exit_code == 0
        a.exec(f"exec -a {marker} sleep 600 >/dev/null 2>&1 &", timeout=30)
        assert a.exec(f"pgrep -f {marker}", timeout=30).exit_code == 0
        seen = b.exec(f"ps -eo args | grep -c '[{marker[0]}]{marker[1:]}'", timeout=30)
        assert seen.stdout == b"0\n", seen
        for path in (f"/workspace/{marker}", f"/tmp/{marker}", f"/usr/{marker}"):
            assert b.exec(["test", "-e", path], timeout=30).exit_code == 1, path
        (host_pid,) = marked(marker)
        b.exec(f"kill -9 {host_pid}", timeout=30)
        assert marked(marker) == {host_pid}
    assert not wait_gone(marker), "destroy left a process of the sandbox"


def test_timeout_kills_the_whole_tree(client):
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    with _sandbox(client) as sb:
        r = sb.exec(f"setsid sleep 1{marker} & sleep 3{marker} & sleep 4{marker}", timeout=2)
        assert r.timed_out
        left = sb.exec(f"ps -eo args | grep '[s]leep [1-4]{marker}'", timeout=30).stdout
        assert left == b"", left


def test_fork_copies_the_writable_layer_and_workspace(client):
    with _sandbox(client) as parent:
        parent.exec("echo root-layer > /etc/forked && echo ws > /workspace/forked", timeout=30)
        (child,) = parent.fork(1)
        with child:
            r = child.exec("cat /etc/forked /workspace/forked", timeout=30)
            assert r.stdout == b"root-layer\nws\n", r
            child.exec("echo child > /workspace/forked", timeout=30)
        assert parent.exec("cat /workspace/forked", timeout=30).stdout == b"ws\n"


def test_daemon_killed_takes_its_sandboxes_along(rootless):
    daemon = rootless.start("killed")
    marker = f"corral-rootless-{secrets.token_hex(4)}"
    try:
        from corral.sdk import Client

        with Client(daemon.address) as c:
            sb = _sandbox(c)
            sb.exec(f"exec -a {marker}-bg sleep 600 >/dev/null 2>&1 &", timeout=30)
            sb.shell("main").run(f"exec -a {marker}-shell sleep 600 &", timeout=30)
        deadline = time.monotonic() + 10
        while len(marked(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(marked(marker)) == 2
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)
        assert not wait_gone(marker), "a sandbox process outlived its daemon"
        assert not wait_gone(str(daemon.state_dir / "sandboxes")), "apptainer outlived its daemon"
        restarted = rootless.start("killed")
        try:
            assert not list((restarted.state_dir / "sandboxes").iterdir())
        finally:
            restarted.stop()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()


def test_snapshot_outlives_its_sandbox(client):
    name = f"rootless-{secrets.token_hex(4)}"
    with _sandbox(client) as parent:
        parent.exec("echo kept > /etc/snapshotted && echo ws > /workspace/snapshotted", timeout=30)
        parent.snapshot(name)
    try:
        (made,) = client.fork_snapshot(name, 1)
        with made:
            r = made.exec("cat /etc/snapshotted /workspace/snapshotted", timeout=30)
            assert r.stdout == b"kept\nws\n", r
    finally:
        client.delete_snapshot(name)
