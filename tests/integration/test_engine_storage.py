"""`docker.storage = "btrfs"` (and "auto", the default, where the node can have it) on Docker and
on Podman: a container's writable layer and its workspace lie on one btrfs subvolume of the
node's pool, capped at limits.disk_bytes, so a write anywhere in the container's root counts
against the sandbox's disk limit (engine_layer.py); and ForkSandbox children start from a
snapshot of both; with "engine" the layer is the engine's, not capped, and nothing forks. The tests look only at their own daemons'
sandboxes, containers and storage pool."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.daemon.backends.storage import StoragePool, create_subvolume
from corral.sdk import Client, errors
from tests.conftest import DOCKER_TEST_IMAGE, DaemonProcess, require_backend, require_image
from tests.integration.test_container_backends import ENGINES, _containers
from tests.integration.test_disk_limits import own_daemon
from tests.integration.test_fork import assert_siblings_isolated, pool_entries, sh

MIB = 1 << 20


def engine_config(engine: str) -> str:
    config = '[docker]\nstorage = "btrfs"\nstorage_bytes = 8589934592\n'
    if engine == "podman":
        config += ENGINES["podman"][1].removeprefix("[docker]\n")
    return config


@pytest.fixture(scope="module", params=list(ENGINES))
def engine_daemon(request, tmp_path_factory) -> Iterator[tuple[str, DaemonProcess]]:
    require_backend(request.param)
    require_image(request.param)
    with own_daemon(tmp_path_factory.mktemp(f"engstore-{request.param}"), engine_config(request.param)) as d:
        yield request.param, d


@pytest.fixture
def client(engine_daemon) -> Iterator[Client]:
    with Client(engine_daemon[1].address) as c:
        yield c


def create(client: Client, **kwargs):
    return client.create_sandbox(image=DOCKER_TEST_IMAGE, backend="docker", **kwargs)


def layer_dir(engine: str, daemon_id: str, sandbox_id: str) -> Path:
    """The engine's directory of the sandbox's container's writable layer."""
    upper = subprocess.run(
        [*ENGINES[engine][0], "inspect", "-f", "{{.GraphDriver.Data.UpperDir}}", f"corral-{daemon_id}-{sandbox_id}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(upper).parent


def test_root_filesystem_writes_count_against_the_disk_limit(client, engine_daemon):
    engine, daemon = engine_daemon
    with create(client, disk_bytes=64 * MIB) as sb:
        disk = next(s for s in sb.info.limit_status if s.kind == "disk")
        assert disk.enforced and "btrfs" in disk.mechanism, disk
        sh(sb, "echo root > /usr/local/rootfile && id -u")
        for path in ("/usr/fill", "/var/tmp/fill"):
            result = sb.exec(f"dd if=/dev/zero of={path} bs=1M count=200; sync; rm -f {path}", timeout=60)
            assert b"Disk quota exceeded" in result.stderr, result.stderr
        assert sh(sb, "cat /usr/local/rootfile") == "root\n"
        # The host's disk did not take the writes: they went to the sandbox's subvolume, which
        # holds both its workspace and the container's writable layer.
        subvolume = daemon.state_dir / "storage" / "sandboxes" / sb.id
        assert (subvolume / "layer" / "diff" / "usr" / "local" / "rootfile").read_text() == "root\n"
        assert os.path.ismount(layer_dir(engine, client.node_info().daemon_id, sb.id))


def test_workspace_and_root_layer_share_one_limit(client):
    with create(client, disk_bytes=64 * MIB) as sb:
        sh(sb, "dd if=/dev/zero of=/workspace/half bs=1M count=40 && sync")
        result = sb.exec("dd if=/dev/zero of=/usr/more bs=1M count=40; sync", timeout=60)
        assert b"Disk quota exceeded" in result.stderr, result.stderr
        sh(sb, "rm -f /usr/more /workspace/half && sync")
        sh(sb, "dd if=/dev/zero of=/usr/more bs=1M count=40 && sync")  # room again once freed


def test_destroy_leaves_no_mount_or_subvolume(client, engine_daemon):
    engine, daemon = engine_daemon
    sb = create(client, disk_bytes=64 * MIB)
    layer = layer_dir(engine, client.node_info().daemon_id, sb.id)
    assert os.path.ismount(layer)
    sb.destroy()
    assert not os.path.ismount(layer) and not layer.exists()
    assert not (daemon.state_dir / "sandboxes" / sb.id).exists()
    assert pool_entries(daemon) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_crashed_daemon_leaves_no_mount_behind(engine, tmp_path):
    require_backend(engine)
    require_image(engine)
    config = tmp_path / "c.toml"
    config.write_text(engine_config(engine))
    d = DaemonProcess(tmp_path, "--config", str(config)).start()
    try:
        with Client(d.address) as c:
            daemon_id = c.node_info().daemon_id
            sb = create(c, disk_bytes=64 * MIB)
            sh(sb, "echo x > /usr/x")
            layer = layer_dir(engine, daemon_id, sb.id)
            # A fork point a crash cut short (the daemon removes its own right after the fork).
            create_subvolume(d.state_dir / "storage" / "forks" / f"{sb.id}-deadbeef")
        d.stop(signal.SIGKILL)
        d.start()
        assert _containers(engine, daemon_id) == []
        assert not os.path.ismount(layer) and not layer.exists()
        assert not os.path.ismount(d.state_dir / "sandboxes" / sb.id)
        assert pool_entries(d) == []
        with Client(d.address) as c, create(c, disk_bytes=64 * MIB) as again:
            assert sh(again, "test ! -e /usr/x && echo fresh") == "fresh\n"
    finally:
        d.stop()


# -- ForkSandbox ----------------------------------------------------------------------------------


def test_children_start_from_the_parent_and_are_isolated(client, engine_daemon):
    engine, daemon = engine_daemon
    parent = create(client, labels={"task": "t1"}, env={"FROM": "parent"}, memory_bytes=1 << 30, disk_bytes=256 * MIB)
    sh(parent, "echo ws > /workspace/a && echo root > /usr/local/rootfile && mkdir /testbed && echo tb > /testbed/x")
    children = parent.fork(3, labels={"rollout": "r"})
    try:
        for child in children:
            assert sh(child, "cat /workspace/a /usr/local/rootfile /testbed/x") == "ws\nroot\ntb\n"
            assert sh(child, 'echo "$FROM"') == "parent\n"
            assert (child.info.image, child.info.limits) == (parent.info.image, parent.info.limits)
            labels = child.info.labels
            assert labels["task"] == "t1" and labels["rollout"] == "r"
            assert labels["corral.fork.generation"] == "1" and labels["corral.fork.parent"] == parent.id
        assert_siblings_isolated(parent, children)
        # The parent kept running through the fork (paused for the snapshot only).
        sh(parent, "echo after > /workspace/late")
        assert sh(children[0], "test ! -e /workspace/late && echo ok") == "ok\n"
    finally:
        for sb in (parent, *children):
            sb.destroy()
    assert pool_entries(daemon) == []


def test_the_parent_keeps_running_through_a_fork(client):
    parent = create(client)
    try:
        # A process of the parent's that runs on: it was paused for the snapshot, not stopped.
        sh(parent, "nohup sh -c 'while :; do echo t >> /tmp/ticks; sleep 0.05; done' >/dev/null 2>&1 &")
        # Its first tick before the fork (under load the loop may not have run yet).
        sh(parent, "for i in $(seq 200); do test -s /tmp/ticks && exit 0; sleep 0.05; done; exit 1")
        with parent.shell() as shell:
            shell.run("export KEPT=yes; mkdir -p /workspace/deep && cd /workspace/deep")
            (child,) = parent.fork(1)
            try:
                assert shell.run('echo "$KEPT $PWD"', timeout=10).output.strip() == b"yes /workspace/deep"
                ticks = int(sh(parent, "wc -l < /tmp/ticks"))
                time.sleep(0.5)
                assert int(sh(parent, "wc -l < /tmp/ticks")) > ticks
                assert child.list_shells() == []  # processes are not copied
                seen = child.exec("test -d /workspace/deep && test -s /tmp/ticks", timeout=30)
                assert seen.exit_code == 0, (
                    sh(child, "ls -la /workspace /tmp; wc -c /tmp/ticks || true"),
                    sh(parent, "ls -la /workspace /tmp; wc -c /tmp/ticks || true"),
                )
            finally:
                child.destroy()
    finally:
        parent.destroy()


def test_fork_of_a_fork_and_the_disk_limit_of_children(client):
    parent = create(client, disk_bytes=64 * MIB)
    made = [parent]
    try:
        sh(parent, "echo one > /usr/one && dd if=/dev/zero of=/workspace/base bs=1M count=30 status=none")
        (child,) = parent.fork(1)
        made.append(child)
        sh(child, "echo two > /usr/two")
        (grandchild,) = child.fork(1)
        made.append(grandchild)
        assert grandchild.info.labels["corral.fork.generation"] == "2"
        assert sh(grandchild, "cat /usr/one /usr/two") == "one\ntwo\n"
        # A child counts what it inherited: 30 of its 64 MiB are taken.
        result = grandchild.exec("dd if=/dev/zero of=/var/tmp/more bs=1M count=40; sync", timeout=60)
        assert b"Disk quota exceeded" in result.stderr, result.stderr
        parent.destroy()
        child.destroy()
        assert sh(grandchild, "cat /usr/one /usr/two") == "one\ntwo\n"  # forks outlive their ancestors
    finally:
        for sb in made:
            sb.destroy()


def docker_disk_status(client: Client):
    backend = next(b for b in client.node_info().backends if b.backend == "docker")
    return next(s for s in backend.limits if s.kind == "disk")


def attached_loops(image: Path) -> str:
    """The loop devices backed by this daemon's pool image."""
    return subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("engine", ENGINES)
def test_the_default_storage_caps_the_writable_layer_and_forks(engine, tmp_path):
    """No docker.storage in the configuration ("auto"): on a node that can have the btrfs pool,
    writes anywhere in the container's root count against limits.disk_bytes and the sandbox
    forks. The pool is mounted when the first container needs it and let go when the daemon
    stops: no loop device or mount outlives it."""
    require_backend(engine)
    require_image(engine)
    if lacking := StoragePool(tmp_path, 0).lacking():
        pytest.skip(f"this node cannot have the btrfs pool: {lacking}")
    with own_daemon(tmp_path, ENGINES[engine][1]) as daemon, Client(daemon.address) as c:
        pool, image = daemon.state_dir / "storage", daemon.state_dir / "storage.img"
        disk = docker_disk_status(c)
        assert disk.enforced and "btrfs" in disk.mechanism, disk
        assert not os.path.ismount(pool)  # (nothing made yet: no pool)
        with create(c, disk_bytes=64 * MIB) as parent:
            result = parent.exec("dd if=/dev/zero of=/usr/fill bs=1M count=100; sync; rm -f /usr/fill", timeout=60)
            assert b"Disk quota exceeded" in result.stderr, result.stderr
            sh(parent, "echo kept > /usr/kept")
            (child,) = parent.fork(1)
            with child:
                assert sh(child, "cat /usr/kept") == "kept\n"
                sh(child, "echo mine > /usr/kept")
            assert sh(parent, "cat /usr/kept") == "kept\n"
        assert os.path.ismount(pool) and attached_loops(image)
    assert not os.path.ismount(pool)
    # (The kernel lets go of the loop device once the filesystem's last user is gone: soon.)
    deadline = time.monotonic() + 10
    while attached_loops(image) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert attached_loops(image) == ""


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_storage_is_not_capped_and_cannot_fork(engine, tmp_path):
    """docker.storage = "engine", the operator's choice: the layer is the engine's, GetNodeInfo
    says the disk is not capped and why, ForkSandbox is FAILED_PRECONDITION, and the daemon
    makes no pool."""
    require_backend(engine)
    require_image(engine)
    config = '[docker]\nstorage = "engine"\n' + ENGINES[engine][1].removeprefix("[docker]\n")
    with own_daemon(tmp_path, config) as daemon, Client(daemon.address) as c:
        disk = docker_disk_status(c)
        assert not disk.enforced and 'docker.storage = "engine"' in disk.reason, disk
        with create(c) as parent:
            with pytest.raises(errors.FailedPrecondition, match='docker.storage = "engine"'):
                parent.fork(1)
            assert [sb.id for sb in c.list_sandboxes()] == [parent.id]
        assert not (daemon.state_dir / "storage.img").exists()


def test_auto_storage_falls_back_to_the_engine_saying_why(tmp_path):
    """The default on a node without btrfs-progs (here: a PATH without mkfs.btrfs): containers
    keep the engine's layer, and GetNodeInfo and ForkSandbox say what the node lacks."""
    require_backend("docker")
    require_image("docker")
    config = tmp_path / "c.toml"
    config.write_text("")
    path = ":".join(p for p in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(p, "mkfs.btrfs")))
    daemon = DaemonProcess(tmp_path, "--config", str(config), env={"PATH": path}).start()
    try:
        with Client(daemon.address) as c:
            disk = docker_disk_status(c)
            assert not disk.enforced and "mkfs.btrfs is not installed" in disk.reason, disk
            with create(c) as parent:
                sh(parent, "echo x > /usr/x")
                with pytest.raises(errors.FailedPrecondition, match='docker.storage = "auto" found no btrfs pool'):
                    parent.fork(1)
        assert not (daemon.state_dir / "storage.img").exists()
        assert "ForkSandbox unavailable" in daemon.log.read_text()
    finally:
        daemon.stop()


def test_a_fork_that_fails_half_way_leaves_nothing(engine_daemon, tmp_path):
    """Room for 3 sandboxes' id blocks: of 4 children, 2 start and 2 cannot; the 2 are removed."""
    engine, _ = engine_daemon
    config = engine_config(engine) + "[sandbox]\nuid_count = 196608\n"
    with own_daemon(tmp_path, config) as daemon, Client(daemon.address) as c:
        daemon_id = c.node_info().daemon_id
        parent = create(c)
        sh(parent, "echo x > /usr/x")
        with pytest.raises(errors.ResourceExhausted):
            parent.fork(4)
        assert [sb.id for sb in c.list_sandboxes()] == [parent.id]
        assert pool_entries(daemon) == [f"sandboxes/{parent.id}"]
        assert len(_containers(engine, daemon_id)) == 1
        children = parent.fork(2)
        assert sh(children[1], "cat /usr/x") == "x\n"


def test_a_named_snapshot_outlives_its_sandbox_and_the_store_is_bounded(engine_daemon, tmp_path):
    engine, _ = engine_daemon
    config = engine_config(engine) + "snapshot_store_bytes = 33554432\n"  # 32 MiB
    with own_daemon(tmp_path, config) as daemon, Client(daemon.address) as c:
        parent = create(c, labels={"task": "snap"})
        sh(parent, "echo kept > /workspace/kept && echo r > /usr/local/r")
        taken = parent.snapshot("setup-1")
        assert taken.sandbox_id == parent.id and taken.size_bytes > 0
        sh(parent, "echo later > /workspace/kept && dd if=/dev/zero of=/usr/big bs=1M count=40 status=none")
        with pytest.raises(errors.ResourceExhausted, match="docker.snapshot_store_bytes"):
            parent.snapshot("too-big")  # 40 MiB more than the 32 the store holds
        parent.destroy()
        made = c.fork_snapshot("setup-1", 2)
        for sb in made:
            assert sh(sb, "cat /workspace/kept /usr/local/r") == "kept\nr\n"
            assert sb.info.labels["task"] == "snap"
        c.delete_snapshot("setup-1")
        assert sh(made[0], "cat /workspace/kept") == "kept\n"
        assert pool_entries(daemon) == sorted(f"sandboxes/{sb.id}" for sb in made)
        with pytest.raises(errors.NotFound):
            c.fork_snapshot("setup-1", 1)


def test_local_and_docker_share_one_pool(tmp_path):
    """Both backends on btrfs storage keep their sandboxes in the one pool of the node (mounted
    once, unmounted when the daemon stops), and a restart after a crash reaps both."""
    require_backend("local")
    require_backend("docker")
    require_image("docker")
    config = engine_config("docker") + '[local]\nstorage = "btrfs"\n'
    with own_daemon(tmp_path, config) as daemon:
        pool = daemon.state_dir / "storage"
        with Client(daemon.address) as c:
            local = c.create_sandbox(backend="local", disk_bytes=64 * MIB)
            engine = create(c, disk_bytes=64 * MIB)
            assert pool_entries(daemon) == sorted(f"sandboxes/{sb.id}" for sb in (local, engine))
            mounted = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
            assert mounted.count(str(pool)) == 1
            for sb in (local, engine):
                result = sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=100; sync", timeout=60)
                assert b"Disk quota exceeded" in result.stderr, result.stderr
        daemon.stop(signal.SIGKILL)
        daemon.start()
        assert pool_entries(daemon) == []
        assert not os.path.ismount(daemon.state_dir / "sandboxes" / engine.id)
    assert not os.path.ismount(pool)
