"""Named snapshots on the Apptainer backend: SnapshotSandbox keeps the fork's copy of a sandbox's
root writable layer and workspace under `<state_dir>/snapshots/singularity/NAME`, ForkSandbox makes
sandboxes from it after its sandbox is gone too (each one's files moved to its own block of host
ids), the store is bounded by singularity.snapshot_store_bytes, and a restarted daemon keeps none.
The tests look only at their own daemons' sandboxes and directories."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from corral.sdk import Client, errors
from tests.conftest import SIF_TEST_IMAGE, DaemonProcess, require_backend, require_image

CONFIG = f'[daemon]\ndefault_backend = "singularity"\n[singularity]\ndefault_image = "{SIF_TEST_IMAGE}"\n'


def start_daemon(root: Path, config: str = CONFIG) -> DaemonProcess:
    require_backend("singularity")
    require_image("singularity")
    (root / "corral.toml").write_text(config)
    return DaemonProcess(root, "--config", str(root / "corral.toml")).start()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    daemon = start_daemon(tmp_path_factory.mktemp("apptainer-snapshots"))
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def client(daemon):
    with Client(daemon.address) as c:
        yield c


def sh(sandbox, script: str, **kw) -> str:
    r = sandbox.exec(script, timeout=60, **kw)
    assert r.exit_code == 0, r
    return r.stdout.decode()


def kept(daemon: DaemonProcess) -> list[str]:
    """The named snapshots the daemon keeps on disk."""
    store = daemon.state_dir / "snapshots" / "singularity"
    return sorted(p.name for p in store.iterdir()) if store.is_dir() else []


def test_a_snapshot_outlives_its_sandbox_in_blocks_of_their_own(client, daemon):
    parent = client.create_sandbox(labels={"task": "snap"})
    sh(
        parent,
        "echo root-layer > /usr/local/snap && echo ws > /workspace/w && rm /etc/debian_version && "
        "install -d -o 1000 -g 1000 /workspace/u && echo mine > /workspace/u/f && chown 1000:1000 /workspace/u/f",
    )
    taken = parent.snapshot("setup-1")
    assert (taken.name, taken.sandbox_id, taken.backend) == ("setup-1", parent.id, "singularity")
    assert taken.labels["task"] == "snap" and taken.size_bytes > 0
    sh(parent, "echo later > /workspace/w")  # after the snapshot: not in it
    parent_block = parent.info.host_id_first
    parent.destroy()
    made = client.fork_snapshot("setup-1", 2, labels={"n": "1"})
    try:
        a, b = made
        # Two blocks of their own (one may be the gone parent's, given back: its files then keep their ids).
        assert a.info.host_id_first != b.info.host_id_first and parent_block not in (0, 1)
        for sb in made:
            assert sb.info.labels["task"] == "snap" and sb.info.labels["corral.fork.parent"] == parent.id
            assert sh(
                sb, "cat /usr/local/snap /workspace/w /workspace/u/f; test -e /etc/debian_version || echo gone"
            ) == ("root-layer\nws\nmine\ngone\n")
            # Root's files are root's inside (on the host: the sandbox's own block), user 1000's its.
            assert sh(sb, "stat -c %u:%g /usr/local/snap /workspace/w /workspace/u/f") == "0:0\n0:0\n1000:1000\n"
            sandbox_dir = daemon.state_dir / "sandboxes" / sb.id
            first = sb.info.host_id_first
            (in_root_layer,) = (sandbox_dir / "layers" / "upper").glob("*/usr/local/snap")
            assert os.stat(in_root_layer).st_uid == first
            assert os.stat(sandbox_dir / "workspace" / "u" / "f").st_uid == first + 1000
            assert sh(sb, "echo more >> /usr/local/snap && echo ok") == "ok\n"
            assert sh(sb, "echo more >> /workspace/u/f && echo ok", user="1000") == "ok\n"
        # Sandboxes made from one snapshot do not see each other's changes.
        sh(a, "echo a > /usr/local/snap && rm /workspace/w && touch /workspace/only-a")
        assert sh(b, "cat /usr/local/snap; ls /workspace") == "root-layer\nmore\nu\nw\n"
        assert kept(daemon) == ["setup-1"]
        client.delete_snapshot("setup-1")
        assert kept(daemon) == [] and client.list_snapshots() == []
        assert sh(b, "cat /workspace/w") == "ws\n"  # sandboxes made from it keep their files
        with pytest.raises(errors.NotFound, match="no snapshot named 'setup-1'"):
            client.fork_snapshot("setup-1", 1)
    finally:
        for sb in made:
            sb.destroy()


def test_snapshot_errors_are_clear(client):
    with client.create_sandbox() as sb:
        sb.snapshot("taken")
        try:
            with pytest.raises(errors.AlreadyExists):
                sb.snapshot("taken")
            with pytest.raises(errors.InvalidArgument):
                sb.snapshot("a/b")
        finally:
            client.delete_snapshot("taken")
    with pytest.raises(errors.NotFound, match="no snapshot named 'missing'"):
        client.fork_snapshot("missing", 1)
    with pytest.raises(errors.NotFound):
        client.delete_snapshot("taken")


def test_the_snapshot_store_is_bounded(tmp_path):
    daemon = start_daemon(tmp_path, CONFIG + "snapshot_store_bytes = 33554432\n")  # 32 MiB
    try:
        with Client(daemon.address) as c, c.create_sandbox() as sb:
            sh(sb, "dd if=/dev/urandom of=/workspace/a bs=1M count=20 status=none")
            first = sb.snapshot("first")
            assert first.size_bytes >= 20 << 20
            with pytest.raises(errors.ResourceExhausted, match="singularity.snapshot_store_bytes"):
                sb.snapshot("second")  # 20 MiB more than the 32 the store holds
            assert [s.name for s in c.list_snapshots()] == ["first"] and kept(daemon) == ["first"]
            c.delete_snapshot("first")
            assert sb.snapshot("second").size_bytes >= 20 << 20
            assert kept(daemon) == ["second"]
    finally:
        daemon.stop()


def test_a_restart_reaps_named_snapshots(tmp_path):
    daemon = start_daemon(tmp_path)
    try:
        with Client(daemon.address) as c:
            c.create_sandbox().snapshot("kept")
        assert kept(daemon) == ["kept"]
        daemon.stop(signal.SIGKILL)
        daemon.start()
        assert kept(daemon) == []
        with Client(daemon.address) as c:
            assert c.list_snapshots() == []
            with pytest.raises(errors.NotFound):
                c.fork_snapshot("kept", 1)
    finally:
        daemon.stop()
