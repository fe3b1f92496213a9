"""What is specific to the container backends: images, engines, leftovers after a crash. What
they share with the local backend is the conformance suite (every test using `daemon`)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from corral.sdk import Client, errors
from tests.conftest import (
    DOCKER_TEST_IMAGE,
    PODMAN_CONFIG,
    PODMAN_SOCKET,
    SIF_TEST_IMAGE,
    DaemonProcess,
    alive_pids,
    require_backend,
    require_image,
    sandbox_pids,
)

# The docker backend on Docker's engine and on Podman's Docker-compatible socket.
ENGINES = {"docker": (["docker"], ""), "podman": (["podman", "--url", PODMAN_SOCKET], PODMAN_CONFIG)}


def _containers(engine: str, daemon_id: str) -> list[str]:
    out = subprocess.run(
        [*ENGINES[engine][0], "ps", "-aq", "--filter", f"label=io.corral.daemon={daemon_id}"],
        capture_output=True,
        text=True,
    ).stdout
    return out.split()


def _engine_daemon(engine: str, tmp_path) -> DaemonProcess:
    config = tmp_path / "engine.toml"
    config.write_text(ENGINES[engine][1])
    return DaemonProcess(tmp_path, "--config", str(config)).start()


@pytest.mark.parametrize("engine", ENGINES)
def test_docker_image_missing_is_not_found(engine, tmp_path):
    require_backend(engine)
    d = _engine_daemon(engine, tmp_path)
    try:
        with Client(d.address) as c:
            [status] = [b for b in c.node_info().backends if b.backend == "docker"]
            assert status.detail.startswith(f"{engine} engine "), status.detail  # which engine answered
            with pytest.raises(errors.NotFound, match="not present"):
                c.create_sandbox(image="corral-test/no-such-image:never", backend="docker")
            with pytest.raises(errors.InvalidArgument):
                c.create_sandbox(backend="docker")  # no default image configured
    finally:
        d.stop()


def test_docker_engine_unreachable_is_unavailable_naming_the_socket(tmp_path):
    require_backend("local")
    config = tmp_path / "c.toml"
    config.write_text('[docker]\nsocket = "unix:///nonexistent/docker.sock"\n')
    d = DaemonProcess(tmp_path, "--config", str(config)).start()
    try:
        with Client(d.address) as c:
            with pytest.raises(errors.Unavailable, match="/nonexistent/docker.sock"):
                c.create_sandbox(image=DOCKER_TEST_IMAGE, backend="docker")
            assert c.list_sandboxes() == []
    finally:
        d.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_docker_containers_carry_labels_and_crash_leftovers_are_removed(engine, tmp_path):
    require_backend(engine)
    require_image(engine)
    d = _engine_daemon(engine, tmp_path)
    with Client(d.address) as c:
        daemon_id = c.node_info().daemon_id
        for _ in range(2):
            sb = c.create_sandbox(image=DOCKER_TEST_IMAGE, backend="docker")
            sb.exec("sleep 1000 >/dev/null 2>&1 &", timeout=10)
    assert len(_containers(engine, daemon_id)) == 2
    d.stop(signal.SIGKILL)
    d.start()
    try:
        assert _containers(engine, daemon_id) == []
        assert not list((d.state_dir / "sandboxes").iterdir())
    finally:
        d.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_configured_ulimits_are_the_containers(engine, tmp_path):
    """`docker.ulimits` reaches the engine: the container's init runs with those rlimits (what
    Podman needs where it cannot raise its defaults). Commands corral runs enter the container
    with nsenter and keep the daemon's rlimits, like on the local backend."""
    require_backend(engine)
    require_image(engine)
    socket = f'socket = "{PODMAN_SOCKET}"\n' if engine == "podman" else ""
    config = tmp_path / "ulimits.toml"
    config.write_text(f'[docker]\n{socket}ulimits = ["nofile=4096:8192", "nproc=2048"]\n')
    d = DaemonProcess(tmp_path, "--config", str(config)).start()
    try:
        with Client(d.address) as c:
            daemon_id = c.node_info().daemon_id
            with c.create_sandbox(image=DOCKER_TEST_IMAGE, backend="docker") as sb:
                [container] = _containers(engine, daemon_id)
                limits = sb.exec("cat /proc/1/limits", timeout=10).stdout.decode()
                assert container
        rows = {line[:26].strip(): line[26:].split()[:2] for line in limits.splitlines()[1:]}
        assert rows["Max open files"] == ["4096", "8192"], limits
        assert rows["Max processes"] == ["2048", "2048"], limits
    finally:
        d.stop()


def test_singularity_image_missing_is_not_found(tmp_path):
    require_backend("singularity")
    d = DaemonProcess(tmp_path).start()
    try:
        with Client(d.address) as c:
            with pytest.raises(errors.NotFound, match="does not exist"):
                c.create_sandbox(image="/nonexistent/image.sif", backend="singularity")
            with pytest.raises(errors.InvalidArgument):
                c.create_sandbox(image="relative.sif", backend="singularity")
    finally:
        d.stop()


def test_singularity_crash_leftovers_are_stopped(tmp_path):
    require_backend("singularity")
    require_image("singularity")
    d = DaemonProcess(tmp_path).start()
    with Client(d.address) as c:
        daemon_id = c.node_info().daemon_id
        sb = c.create_sandbox(image=SIF_TEST_IMAGE, backend="singularity")
        sb.exec("sleep 1000 >/dev/null 2>&1 &", timeout=10)
    pids = sandbox_pids(daemon_id)
    assert len(pids) >= 3  # apptainer's starter, the sandbox's init, the sleep
    sandbox_dir = d.state_dir / "sandboxes" / sb.id
    assert os.path.ismount(sandbox_dir / "root") and os.path.ismount(sandbox_dir / "image")
    d.stop(signal.SIGKILL)
    d.start()
    try:
        assert not alive_pids(pids)
        assert not sandbox_dir.exists()
    finally:
        d.stop()
