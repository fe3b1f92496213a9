"""engine_layer.py's checks: which container layers the daemon can place on a sandbox's storage,
and the start-time proof that the engine writes the container's root there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from corral.daemon.backends.docker import engine_layer
from corral.daemon.config import ConfigError, load_config
from corral.sdk.errors import FailedPrecondition


def inspect(name: str, upper: str, work: str) -> dict:
    return {"GraphDriver": {"Name": name, "Data": {"UpperDir": upper, "WorkDir": work}}}


def test_an_overlay_layer_is_the_parent_of_its_upper_and_work_directories():
    for driver in ("overlay2", "overlay"):
        attrs = inspect(driver, "/var/lib/e/overlay2/abc/diff", "/var/lib/e/overlay2/abc/work")
        assert engine_layer.layer_dir(attrs) == Path("/var/lib/e/overlay2/abc")


@pytest.mark.parametrize(
    ("attrs", "says"),
    [
        (inspect("vfs", "", ""), "'vfs'"),
        (inspect("btrfs", "/x/diff", "/x/work"), "'btrfs'"),
        ({}, "'none'"),
        (inspect("overlay2", "/a/diff", "/b/work"), "apart"),
        (inspect("overlay2", "/a/upper", "/a/work"), "apart"),
    ],
)
def test_other_layers_are_failed_precondition_naming_why(attrs, says):
    with pytest.raises(FailedPrecondition, match=says):
        engine_layer.layer_dir(attrs)


@pytest.fixture
def chrooted(tmp_path):
    """A process of this test's whose root is `tmp_path/root` (as a container's init's is its
    root filesystem), and that directory."""
    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    root = tmp_path / "root"
    root.mkdir()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.chroot(root)
        os.write(write, b"x")
        signal.pause()
        os._exit(0)
    os.close(write)
    os.read(read, 1)
    os.close(read)
    yield pid, root
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_the_start_check_passes_when_the_root_writes_into_the_sandboxs_layer(chrooted, tmp_path):
    pid, root = chrooted
    sandbox_dir = tmp_path / "sandbox"
    (sandbox_dir / engine_layer.LAYER).mkdir(parents=True)
    (sandbox_dir / engine_layer.LAYER / engine_layer.UPPER).symlink_to(root)  # (as the bind would)
    engine_layer.check_used(pid, sandbox_dir)
    assert list(root.iterdir()) == []  # the probe is gone again


def test_the_start_check_fails_where_the_engine_does_not_see_the_bind(chrooted, tmp_path):
    pid, root = chrooted
    sandbox_dir = tmp_path / "sandbox"
    (sandbox_dir / engine_layer.LAYER / engine_layer.UPPER).mkdir(parents=True)
    with pytest.raises(FailedPrecondition, match="mount namespace of its own"):
        engine_layer.check_used(pid, sandbox_dir)
    assert list(root.iterdir()) == []


def mounted(path: Path) -> bool:
    """Whether something is mounted at `path` (a bind within one filesystem too)."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return str(path) in points


@pytest.fixture
def engine_dir(tmp_path):
    """A layer directory as an engine with user namespace remapping makes it (owned by the
    remapped root), with what overlay left in its scratch space."""
    if os.geteuid() != 0:
        pytest.skip("binding needs root")
    layer = tmp_path / "engine" / "abc"
    (layer / "diff").mkdir(parents=True)
    (layer / "work" / "work").mkdir(parents=True)
    (layer / "link").write_text("SHORTNAME")
    (layer / "lower").write_text("l/A:l/B")
    for path in (layer, layer / "diff", layer / "work", layer / "work" / "work", layer / "link", layer / "lower"):
        os.chown(path, 100000, 100000)
    os.chmod(layer / "work" / "work", 0)
    os.chmod(layer, 0o710)
    yield layer
    engine_layer.take_away(layer)


def test_placing_keeps_the_engines_entries_and_owners_and_binds_them_over(engine_dir, tmp_path):
    sandbox_dir = tmp_path / "sandbox"
    sandbox_dir.mkdir()
    engine_layer.place(engine_dir, sandbox_dir, inherited=False)
    assert mounted(engine_dir)
    ours = sandbox_dir / engine_layer.LAYER
    for name in ("", "diff", "work", "work/work", "link", "lower"):
        st = os.lstat(ours / name)
        assert (st.st_uid, st.st_gid) == (100000, 100000), name
    assert os.lstat(ours / "work" / "work").st_mode & 0o777 == 0
    assert os.lstat(ours).st_mode & 0o777 == 0o710
    (engine_dir / "diff" / "written").write_text("x")  # what the engine writes lands in ours
    assert (ours / "diff" / "written").read_text() == "x"
    engine_layer.take_away(engine_dir)
    assert not mounted(engine_dir) and not (engine_dir / "diff" / "written").exists()


def test_a_childs_layer_keeps_its_parents_changes_and_takes_the_rest_from_the_engine(engine_dir, tmp_path):
    sandbox_dir = tmp_path / "sandbox"
    inherited = sandbox_dir / engine_layer.LAYER
    (inherited / "diff" / "usr").mkdir(parents=True)
    (inherited / "diff" / "usr" / "parents").write_text("p")
    (inherited / "work" / "work" / "stale").mkdir(parents=True)
    (inherited / "link").write_text("PARENTSNAME")
    engine_layer.place(engine_dir, sandbox_dir, inherited=True)
    assert (engine_dir / "diff" / "usr" / "parents").read_text() == "p"
    assert not (inherited / "work" / "work" / "stale").exists()
    assert (engine_dir / "link").read_text() == "SHORTNAME"


def test_docker_storage_settings_are_checked(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[docker]\nstorage = "btrfs"\nstorage_bytes = 8589934592\nsnapshot_store_bytes = 0\n')
    settings = load_config(toml, environ={}).backend("docker")
    assert (settings.storage, settings.storage_bytes, settings.snapshot_store_bytes) == ("btrfs", 8 << 30, 0)
    assert load_config(None, environ={}).backend("docker").storage == "auto"
    for bad, says in (('storage = "xfs"', "auto, btrfs, engine"), ("storage_bytes = -1", "storage_bytes")):
        toml.write_text(f"[docker]\n{bad}\n")
        with pytest.raises(ConfigError, match=f"docker.*{says}"):
            load_config(toml, environ={})


def serve(path: Path, *prefix: str) -> subprocess.Popen:
    """A process listening on a Unix socket at `path` (an engine's socket, as the daemon sees it)."""
    script = (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind({str(path)!r}); s.listen()\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([*prefix, sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_auto_storage_wants_an_overlay_engine_in_the_daemons_mount_namespace(tmp_path):
    """docker.storage = "auto" keeps the engine's layer where the engine would not see the bind
    of the sandbox's layer: a process serving the socket in a mount namespace of its own."""
    overlay = {"Driver": "overlay2"}
    assert "vfs" in engine_layer.lacking({"Driver": "vfs"}, "")
    assert engine_layer.lacking(overlay, "tcp://127.0.0.1:2375") == ""  # (left to the start's proof)
    for prefix, says in (((), ""), (("unshare", "--mount"), "mount namespace of its own")):
        server = serve(tmp_path / f"engine{len(prefix)}.sock", *prefix)
        try:
            lacking = engine_layer.lacking(overlay, f"unix://{tmp_path}/engine{len(prefix)}.sock")
            assert says in lacking and bool(lacking) == bool(says), lacking
        finally:
            server.kill()
            server.wait()
            server.stdout.close()
