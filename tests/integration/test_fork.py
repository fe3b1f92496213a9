"""ForkSandbox on the local backend with copy-on-write storage (local.storage = "btrfs"): children
start from a snapshot of the parent's writable filesystem (workspace, /tmp, the root's writable
layer), are isolated from each other and from the parent, keep the parent's limits, user and
labels (plus a generation), and a fork that fails leaves nothing behind. The tests look only at
their own daemons' sandboxes and storage pool."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from corral.daemon.backends.storage import create_subvolume
from corral.sdk import Client, errors
from tests.conftest import DaemonProcess, require_backend
from tests.integration.test_disk_limits import own_daemon

BTRFS = '[local]\nstorage = "btrfs"\nstorage_bytes = 8589934592\n'


@pytest.fixture(scope="module", params=("bwrap", "unshare"))
def fork_daemon(request, tmp_path_factory) -> Iterator[DaemonProcess]:
    require_backend("local")
    config = BTRFS + f'isolation = "{request.param}"\n'
    with own_daemon(tmp_path_factory.mktemp(f"fork-{request.param}"), config) as d:
        yield d


@pytest.fixture
def client(fork_daemon) -> Iterator[Client]:
    with Client(fork_daemon.address) as c:
        yield c


def pool_entries(daemon: DaemonProcess) -> list[str]:
    """The subvolumes of the daemon's storage pool (sandboxes, fork points, named snapshots)."""
    pool = daemon.state_dir / "storage"
    return sorted(
        str(p.relative_to(pool)) for sub in ("sandboxes", "forks", "snapshots") for p in (pool / sub).iterdir()
    )


def sh(sandbox, script: str) -> str:
    result = sandbox.exec(script, timeout=30)
    assert result.exit_code == 0, (script, result.stdout, result.stderr)
    return result.stdout.decode()


def destroy_all(*sandboxes) -> None:
    for sb in sandboxes:
        sb.destroy()


def assert_siblings_isolated(parent, children) -> None:
    """Three children of a parent holding /workspace/a, /usr/local/rootfile and /testbed/x: a
    write in one is seen by no other nor the parent, a deletion in one leaves theirs."""
    first, second, third = children
    sh(first, "echo mine > /workspace/new && echo changed > /usr/local/rootfile")
    sh(second, "rm /workspace/a /usr/local/rootfile /testbed/x")
    for other in (second, third, parent):
        assert sh(other, "test ! -e /workspace/new && echo absent") == "absent\n"
    for other in (third, parent):
        assert sh(other, "cat /workspace/a /usr/local/rootfile /testbed/x") == "ws\nroot\ntb\n"
    assert sh(first, "cat /workspace/a /usr/local/rootfile") == "ws\nchanged\n"


def test_children_start_from_the_parent_and_are_isolated(client):
    parent = client.create_sandbox(labels={"task": "t1"}, env={"FROM": "parent"}, memory_bytes=1 << 30, pids=300)
    sh(
        parent,
        "echo ws > /workspace/a && echo tmp > /tmp/t && echo root > /usr/local/rootfile "
        "&& mkdir /testbed && echo tb > /testbed/x && rm /etc/hostname",
    )
    children = parent.fork(3, labels={"rollout": "r"})
    try:
        assert len({c.id for c in children} | {parent.id}) == 4
        for child in children:
            assert sh(child, "cat /workspace/a /tmp/t /usr/local/rootfile /testbed/x") == "ws\ntmp\nroot\ntb\n"
            assert sh(child, "test ! -e /etc/hostname && echo gone") == "gone\n"
            assert sh(child, 'echo "$FROM"') == "parent\n"
            info = child.info
            assert (info.image, info.limits, info.user, info.network) == (
                parent.info.image,
                parent.info.limits,
                parent.info.user,
                parent.info.network,
            )
            labels = child.info.labels
            assert labels["task"] == "t1" and labels["rollout"] == "r"
            assert labels["corral.fork.generation"] == "1" and labels["corral.fork.parent"] == parent.id
        assert_siblings_isolated(parent, children)
    finally:
        destroy_all(parent, *children)


def test_the_parent_keeps_working_during_and_after_a_fork(client):
    parent = client.create_sandbox()
    try:
        # A process of the parent's that runs on: it was paused for the snapshot, not stopped.
        sh(parent, "nohup sh -c 'while :; do echo t >> /tmp/ticks; sleep 0.05; done' >/dev/null 2>&1 &")
        with parent.shell() as shell:
            shell.run("export KEPT=yes; mkdir -p /workspace/deep && cd /workspace/deep")
            children = parent.fork(2)
            try:
                assert shell.run('echo "$KEPT $PWD"', timeout=10).output.strip() == b"yes /workspace/deep"
                ticks = int(sh(parent, "wc -l < /tmp/ticks"))
                time.sleep(0.5)
                assert int(sh(parent, "wc -l < /tmp/ticks")) > ticks
                sh(parent, "echo after > /workspace/late")
                for child in children:
                    # Processes are not copied: a child has no shell of its parent's.
                    assert child.list_shells() == []
                    assert sh(child, "test -d /workspace/deep && test ! -e /workspace/late && echo ok") == "ok\n"
            finally:
                destroy_all(*children)
        assert sh(parent, "cat /workspace/late") == "after\n"
    finally:
        parent.destroy()


def test_fork_of_a_fork_keeps_files_and_owners(client, fork_daemon):
    parent = client.create_sandbox()
    made = [parent]
    try:
        sh(parent, "echo one > /workspace/one && echo u > /tmp/u && chown 1000:1000 /tmp/u")
        (child,) = parent.fork(1)
        made.append(child)
        sh(child, "echo two > /workspace/two")
        (grandchild,) = child.fork(1)
        made.append(grandchild)
        assert grandchild.info.labels["corral.fork.generation"] == "2"
        assert grandchild.info.labels["corral.fork.parent"] == child.id
        assert sh(grandchild, "cat /workspace/one /workspace/two") == "one\ntwo\n"
        # Owners as inside ids, whatever block of host ids each sandbox has.
        assert sh(grandchild, "stat -c %u:%g /tmp/u /workspace/one") == "1000:1000\n0:0\n"
        sh(grandchild, "echo three > /workspace/one && touch /workspace/new")  # root inside may write them
        assert sh(parent, "cat /workspace/one; test ! -e /workspace/two && echo no-two") == "one\nno-two\n"
        # Forks outlive their ancestors: nothing of theirs depends on them.
        parent.destroy()
        child.destroy()
        assert sh(grandchild, "cat /workspace/one /workspace/two /tmp/u") == "three\ntwo\nu\n"
    finally:
        destroy_all(*made)


def test_disk_limit_applies_to_children(client):
    cap = 64 << 20
    parent = client.create_sandbox(disk_bytes=cap)
    try:
        sh(parent, "dd if=/dev/urandom of=/workspace/base bs=1M count=40 status=none")
        (child,) = parent.fork(1)
        try:
            assert child.info.limits.disk_bytes == cap
            out = child.exec("dd if=/dev/zero of=/workspace/more bs=1M count=40 2>&1; sync", timeout=60).stdout
            assert b"Disk quota exceeded" in out, out
            # The parent's own room is its own.
            sh(parent, "dd if=/dev/zero of=/workspace/more bs=1M count=8 status=none")
        finally:
            child.destroy()
    finally:
        parent.destroy()


@pytest.mark.parametrize("count", [0, 65])
def test_a_count_out_of_range_is_invalid_and_leaves_nothing(client, fork_daemon, count):
    parent = client.create_sandbox()
    try:
        with pytest.raises(errors.InvalidArgument, match="between 1 and 64"):
            parent.fork(count)
        assert [sb.id for sb in client.list_sandboxes()] == [parent.id]
        assert pool_entries(fork_daemon) == [f"sandboxes/{parent.id}"]
    finally:
        parent.destroy()


def test_a_sandbox_that_is_gone_is_not_found(client):
    gone = client.create_sandbox()
    gone.destroy()
    with pytest.raises(errors.NotFound):
        gone.fork(1)


def test_a_draining_node_refuses_forks_and_a_childs_lease_is_its_own(client, fork_daemon):
    """Forks go through the node's admission: refused while it drains (no fork point made), and
    a child has the lease the fork asked for, not its parent's: it is reaped when that runs out."""
    parent = client.create_sandbox(lease_ttl_s=600)
    try:
        client.drain()
        try:
            with pytest.raises(errors.Unavailable, match="draining"):
                parent.fork(2)
        finally:
            client.drain(False)
        assert pool_entries(fork_daemon) == [f"sandboxes/{parent.id}"]
        (child,) = parent.fork(1, lease_ttl_s=0.5)
        assert child.info.lease_ttl == 0.5
        deadline = time.monotonic() + 10
        while child.id in {sb.id for sb in client.list_sandboxes()} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [sb.id for sb in client.list_sandboxes()] == [parent.id]
        assert pool_entries(fork_daemon) == [f"sandboxes/{parent.id}"]
    finally:
        parent.destroy()


def test_a_fork_that_fails_half_way_leaves_nothing(tmp_path):
    """Room for 3 sandboxes' id blocks: of 4 children, 2 start and 2 cannot; the 2 are removed."""
    require_backend("local")
    with own_daemon(tmp_path, BTRFS + "[sandbox]\nuid_count = 196608\n") as daemon, Client(daemon.address) as c:
        parent = c.create_sandbox()
        sh(parent, "echo x > /workspace/x")
        with pytest.raises(errors.ResourceExhausted):
            parent.fork(4)
        assert [sb.id for sb in c.list_sandboxes()] == [parent.id]
        assert pool_entries(daemon) == [f"sandboxes/{parent.id}"]
        assert sorted(p.name for p in (daemon.state_dir / "sandboxes").iterdir()) == [parent.id]
        # ...and the node is whole: a fork that fits works.
        children = parent.fork(2)
        assert sh(children[1], "cat /workspace/x") == "x\n"


def test_without_copy_on_write_storage_fork_is_failed_precondition(tmp_path):
    require_backend("local")
    with own_daemon(tmp_path, "") as daemon, Client(daemon.address) as c:
        parent = c.create_sandbox()
        with pytest.raises(errors.FailedPrecondition, match='local.storage = "btrfs"'):
            parent.fork(1)
        assert [sb.id for sb in c.list_sandboxes()] == [parent.id]


def test_a_restart_reaps_children_and_fork_points(tmp_path):
    require_backend("local")
    with own_daemon(tmp_path, BTRFS) as daemon:
        with Client(daemon.address) as c:
            parent = c.create_sandbox()
            children = parent.fork(2)
            # A fork point a crash cut short (the daemon removes its own right after the fork).
            create_subvolume(daemon.state_dir / "storage" / "forks" / f"{parent.id}-deadbeef")
            assert len(pool_entries(daemon)) == 4
        daemon.stop(signal.SIGKILL)
        daemon.start()
        assert pool_entries(daemon) == []
        assert list((daemon.state_dir / "sandboxes").iterdir()) == []
        with Client(daemon.address) as c:
            assert c.list_sandboxes() == []
            with pytest.raises(errors.NotFound):
                c.get_sandbox(children[0].id)


def test_fork_timing(client):
    """Not a benchmark (bench/fork.py is): 16 children answer a command within seconds."""
    parent = client.create_sandbox()
    try:
        start = time.monotonic()
        children = parent.fork(16)
        for child in children:
            sh(child, "true")
        assert time.monotonic() - start < 30
        destroy_all(*children)
    finally:
        parent.destroy()


def test_cli_fork_prints_the_children(client, fork_daemon):
    parent = client.create_sandbox()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "corral.cli", "--address", fork_daemon.address, "fork", parent.id, "-n", "2"]
            + ["--label", "k=v"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        ids = done.stdout.split()
        assert len(ids) == 2
        for child_id in ids:
            child = client.get_sandbox(child_id)
            assert child.info.labels["k"] == "v" and child.info.labels["corral.fork.parent"] == parent.id
            child.destroy()
        bad = subprocess.run(
            [sys.executable, "-m", "corral.cli", "--address", fork_daemon.address, "fork", parent.id, "-n", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "between 1 and 64" in bad.stderr
        cli = [sys.executable, "-m", "corral.cli", "--address", fork_daemon.address]
        taken = subprocess.run([*cli, "snapshot", "take", parent.id, "cli-snap"], capture_output=True, text=True)
        assert taken.returncode == 0 and taken.stdout.startswith("cli-snap "), taken.stderr
        listed = subprocess.run([*cli, "snapshot", "ls"], capture_output=True, text=True)
        assert "cli-snap" in listed.stdout and parent.id in listed.stdout
        made = subprocess.run([*cli, "fork", "--snapshot", "cli-snap"], capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        client.get_sandbox(made.stdout.strip()).destroy()
        assert subprocess.run([*cli, "snapshot", "rm", "cli-snap"]).returncode == 0
    finally:
        parent.destroy()


def test_a_named_snapshot_outlives_its_sandbox(client, fork_daemon):
    parent = client.create_sandbox(labels={"task": "snap"})
    sh(parent, "echo kept > /workspace/kept && echo r > /usr/local/r")
    taken = parent.snapshot("setup-1")
    assert taken.name == "setup-1" and taken.sandbox_id == parent.id and taken.labels["task"] == "snap"
    assert taken.size_bytes > 0
    sh(parent, "echo later > /workspace/kept")  # after the snapshot: not in it
    parent.destroy()
    made = []
    try:
        assert [s.name for s in client.list_snapshots()] == ["setup-1"]
        made = client.fork_snapshot("setup-1", 2, labels={"n": "1"})
        for sb in made:
            assert sh(sb, "cat /workspace/kept /usr/local/r") == "kept\nr\n"
            assert sb.info.labels["task"] == "snap" and sb.info.labels["corral.fork.parent"] == parent.id
        with pytest.raises(errors.AlreadyExists):
            made[0].snapshot("setup-1")
        client.delete_snapshot("setup-1")
        assert sh(made[0], "cat /workspace/kept") == "kept\n"  # sandboxes made from it keep their files
        assert client.list_snapshots() == []
        assert pool_entries(fork_daemon) == sorted(f"sandboxes/{sb.id}" for sb in made)
    finally:
        destroy_all(*made)


def test_snapshot_errors_are_clear(client):
    with pytest.raises(errors.NotFound, match="no snapshot named 'missing'"):
        client.fork_snapshot("missing", 1)
    with pytest.raises(errors.NotFound):
        client.delete_snapshot("missing")
    parent = client.create_sandbox()
    try:
        for bad in ("", "-x", "a/b", "x" * 129):
            with pytest.raises(errors.InvalidArgument):
                parent.snapshot(bad)
    finally:
        parent.destroy()


def test_the_snapshot_store_is_bounded(tmp_path):
    require_backend("local")
    config = BTRFS + "snapshot_store_bytes = 33554432\n"  # 32 MiB
    with own_daemon(tmp_path, config) as daemon, Client(daemon.address) as c:
        sb = c.create_sandbox()
        sh(sb, "dd if=/dev/zero of=/workspace/a bs=1M count=20 status=none")
        first = sb.snapshot("first")
        assert first.size_bytes >= 20 << 20
        with pytest.raises(errors.ResourceExhausted, match="snapshot_store_bytes"):
            sb.snapshot("second")  # 20 MiB more than the 32 the store holds
        assert [s.name for s in c.list_snapshots()] == ["first"]
        assert pool_entries(daemon) == [f"sandboxes/{sb.id}", "snapshots/first"]
        c.delete_snapshot("first")
        sb.snapshot("second")


def test_a_restart_reaps_named_snapshots(tmp_path):
    require_backend("local")
    with own_daemon(tmp_path, BTRFS) as daemon:
        with Client(daemon.address) as c:
            c.create_sandbox().snapshot("kept")
        daemon.stop(signal.SIGKILL)
        daemon.start()
        assert pool_entries(daemon) == []
        with Client(daemon.address) as c:
            assert c.list_snapshots() == []
