"""ForkSandbox and named snapshots on the local backend of a daemon without root (docs/local-
backend.md, "Without root"): copies of the parent's root's writable layer, workspace and /tmp,
taken while its processes are stopped (no cgroup freezer), reflinked where the state directory's
filesystem can. A real `corral serve` run as an unprivileged user (rootless_daemons.py), driven
through the SDK, with both disk caps: the capped tmpfs (the copy read and written through the
sandboxes' own mount namespaces) and the watched one (plain directories)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import DaemonProcess
from tests.integration.rootless_daemons import RootlessDaemon, rootless_place

MiB = 1 << 20
# A cap a capped tmpfs holds (under local.rootless_tmpfs_max_bytes), and one the daemon watches.
DISK_CAPS = {"tmpfs": 64 * MiB, "watched": 4 << 30}


@pytest.fixture(scope="module")
def rootless() -> Iterator[RootlessDaemon]:
    with rootless_place() as place:
        yield place


@pytest.fixture(scope="module")
def fork_daemon(rootless) -> Iterator[DaemonProcess]:
    with rootless.running("fork", config="[local]\nsnapshot_store_bytes = 134217728\n") as daemon:
        yield daemon


@pytest.fixture
def client(fork_daemon):
    from corral.sdk import Client

    with Client(fork_daemon.address) as c:
        yield c


# Starts a process that stops itself in a session of its own, its pid in /tmp/stopped, and
# returns once it is stopped.
STOPPED_IN_ITS_OWN_SESSION = """
setsid sh -c 'echo $$ > /tmp/stopped.new && mv /tmp/stopped.new /tmp/stopped && kill -STOP $$ && exec sleep 600' \
  >/dev/null 2>&1 &
until [ -e /tmp/stopped ] && grep -q '^State:.*T' /proc/$(cat /tmp/stopped)/status; do sleep 0.05; done
"""


def sh(sandbox, script: str) -> str:
    r = sandbox.exec(script, timeout=60)
    assert r.exit_code == 0, r
    return r.stdout.decode()


def destroy_all(*sandboxes) -> None:
    for sandbox in sandboxes:
        sandbox.destroy()


@pytest.mark.parametrize("disk", sorted(DISK_CAPS))
def test_children_start_from_the_parent_and_are_isolated(client, disk):
    parent = client.create_sandbox(image="host", disk_bytes=DISK_CAPS[disk])
    sh(
        parent,
        "echo ws > /workspace/a && echo tmp > /tmp/t && echo root > /usr/rootfile "
        "&& mkdir /testbed && echo tb > /testbed/x && rm /etc/hostname && mkdir /tmp/shut && chmod 000 /tmp/shut",
    )
    children = parent.fork(3, labels={"rollout": "r"})
    try:
        for child in children:
            assert child.info.limits.disk_bytes == DISK_CAPS[disk]
            assert sh(child, "cat /workspace/a /tmp/t /usr/rootfile /testbed/x") == "ws\ntmp\nroot\ntb\n"
            # A deletion of the image's file (a whiteout) and a directory nobody may read, copied.
            assert sh(child, "test ! -e /etc/hostname && stat -c %a /tmp/shut") == "0\n"
            assert child.info.labels["corral.fork.parent"] == parent.id
        first, second, third = children
        sh(first, "echo mine > /workspace/new && echo changed > /usr/rootfile")
        sh(second, "rm /workspace/a /usr/rootfile /testbed/x")
        for other in (second, third, parent):
            assert sh(other, "test ! -e /workspace/new && echo absent") == "absent\n"
        for other in (third, parent):
            assert sh(other, "cat /workspace/a /usr/rootfile /testbed/x") == "ws\nroot\ntb\n"
        assert sh(first, "cat /workspace/a /usr/rootfile") == "ws\nchanged\n"
    finally:
        destroy_all(parent, *children)


@pytest.mark.parametrize("disk", sorted(DISK_CAPS))
def test_a_directory_image_forks_from_its_writable_layer(client, disk):
    """A directory image's root is one overlay: its writable layer (not the image) is copied."""
    from tests.conftest import SWE_ROOTFS_IMAGE, require_image

    require_image("local", local_image=SWE_ROOTFS_IMAGE)
    parent = client.create_sandbox(image=SWE_ROOTFS_IMAGE, disk_bytes=DISK_CAPS[disk])
    try:
        sh(parent, "mkdir /scratch && echo made > /scratch/x && echo ws > /workspace/a")
        children = parent.fork(2)
        try:
            for child in children:
                assert sh(child, "cat /scratch/x /workspace/a") == "made\nws\n"
            sh(children[0], "echo changed > /scratch/x")
            assert sh(children[1], "cat /scratch/x") == "made\n"
        finally:
            destroy_all(*children)
    finally:
        parent.destroy()


def test_a_childs_disk_cap_is_its_own(client):
    parent = client.create_sandbox(image="host", disk_bytes=DISK_CAPS["tmpfs"])
    try:
        sh(parent, "head -c 40M /dev/zero > /workspace/base")
        (child,) = parent.fork(1)
        try:
            # The copy counts against the child's cap, as the parent's file against the parent's.
            out = child.exec("head -c 40M /dev/zero > /tmp/more; echo rc=$?", timeout=60)
            assert b"No space left on device" in out.stderr and out.stdout == b"rc=1\n", out
            sh(parent, "head -c 8M /dev/zero > /workspace/more")
        finally:
            child.destroy()
    finally:
        parent.destroy()


def test_the_parent_keeps_working_during_and_after_a_fork(client):
    parent = client.create_sandbox(image="host")
    try:
        # A process of the parent's runs on: it was stopped for the copy, then resumed.
        sh(parent, "nohup sh -c 'while :; do echo t >> /tmp/ticks; sleep 0.05; done' >/dev/null 2>&1 &")
        # So does a command running through the fork (nsenter, outside, stops with its child).
        running: list = []
        call = threading.Thread(target=lambda: running.append(parent.exec("sleep 2; echo done", timeout=60)))
        call.start()
        time.sleep(0.5)
        with parent.shell() as shell:
            shell.run("export KEPT=yes; mkdir -p /workspace/deep && cd /workspace/deep")
            children = parent.fork(2)
            try:
                call.join(30)
                assert running and running[0].stdout == b"done\n", running
                assert shell.run('echo "$KEPT $PWD"', timeout=10).output.strip() == b"yes /workspace/deep"
                ticks = int(sh(parent, "wc -l < /tmp/ticks"))
                time.sleep(0.5)
                assert int(sh(parent, "wc -l < /tmp/ticks")) > ticks
                # A stopped process of the parent's was not resumed by the fork. (It stops itself
                # in a session of its own: a stopped process whose process group the exec's end
                # orphans gets SIGHUP from the kernel.)
                sh(parent, STOPPED_IN_ITS_OWN_SESSION)
                (third,) = parent.fork(1)
                children.append(third)
                assert sh(parent, "ps -o stat= -p $(cat /tmp/stopped)").startswith("T")
                for child in children:
                    assert child.list_shells() == []
                    assert sh(child, "test -d /workspace/deep && echo ok") == "ok\n"
            finally:
                destroy_all(*children)
    finally:
        parent.destroy()


def test_snapshots_outlive_their_sandbox_and_are_bounded(client, fork_daemon):
    from corral.sdk.errors import ResourceExhausted

    name = f"snap-{time.monotonic_ns()}"
    parent = client.create_sandbox(image="host")
    try:
        sh(parent, "echo kept > /workspace/kept && echo usr > /usr/kept")
        info = parent.snapshot(name)
        assert info.size_bytes > 0
        sh(parent, "echo later > /workspace/kept")
    finally:
        parent.destroy()
    assert name in [s.name for s in client.list_snapshots()]
    (child,) = client.fork_snapshot(name)
    try:
        assert sh(child, "cat /workspace/kept /usr/kept") == "kept\nusr\n"
    finally:
        child.destroy()
    client.delete_snapshot(name)
    assert not list((fork_daemon.state_dir / "snapshots" / "local").iterdir())
    # What snapshots may hold together (local.snapshot_store_bytes = 128 MiB here): refused past it.
    big = client.create_sandbox(image="host")
    try:
        sh(big, "head -c 150M /dev/urandom > /workspace/big")
        with pytest.raises(ResourceExhausted, match="snapshot_store_bytes"):
            big.snapshot(f"{name}-big")
    finally:
        big.destroy()
    assert not list((fork_daemon.state_dir / "snapshots" / "local").iterdir())


def test_a_killed_daemons_snapshots_are_removed_at_its_next_start(rootless):
    from corral.sdk import Client

    daemon = rootless.start("reaped")
    try:
        with Client(daemon.address) as c:
            sb = c.create_sandbox(image="host")
            sh(sb, "echo kept > /workspace/kept")
            sb.snapshot("left")
        kept = daemon.state_dir / "snapshots" / "local"
        assert [p.name for p in kept.iterdir()] == ["left"]
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)
        restarted = rootless.start("reaped")
        try:
            assert not kept.exists() or not list(kept.iterdir())
            with Client(restarted.address) as c:
                assert c.list_snapshots() == []
        finally:
            restarted.stop()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
