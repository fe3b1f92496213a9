"""The docker backend's btrfs storage (docker.storage = "btrfs") on its failure paths, with the
engine and the pool replaced by stand-ins that record what was asked of them: a fork whose
parent the engine cannot resume, a teardown that fails half-way, an engine that comes up after
the daemon's start. tests/integration/test_engine_storage.py runs the real thing."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from corral.daemon.backends.base import BackendStatus, ManagedSandbox
from corral.daemon.backends.docker import backend as docker_backend
from corral.daemon.backends.docker.backend import DockerBackend, DockerSandbox
from corral.sdk.errors import FailedPrecondition


class _Engine:
    """The backend's engine calls, made at once."""

    async def engine(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


class _StuckContainer:
    """A container the engine pauses and then never resumes."""

    attrs = {"State": {"Paused": True}}

    def pause(self) -> None:
        pass

    def unpause(self) -> None:
        raise FailedPrecondition("the engine refused to unpause")

    def reload(self) -> None:
        pass


def _sandbox(tmp_path: Path) -> DockerSandbox:
    """A DockerSandbox on the stand-ins, its subvolume a plain directory."""
    sandbox = DockerSandbox.__new__(DockerSandbox)
    sandbox.backend = _Engine()  # type: ignore[assignment]
    sandbox.spec = SimpleNamespace(sandbox_id="sb-test")  # type: ignore[assignment]
    sandbox.uid = 0
    sandbox.cgroup = None
    sandbox.container = _StuckContainer()  # type: ignore[assignment]
    sandbox.sandbox_dir = tmp_path / "sandbox"
    sandbox.subvolume = tmp_path / "subvolume"
    sandbox.subvolume.mkdir()
    sandbox.layer_dir = None
    return sandbox


@pytest.fixture
def deleted(monkeypatch) -> list[Path]:
    """Subvolumes deleted (plain directories here)."""
    gone: list[Path] = []

    def delete(path: Path) -> None:
        gone.append(path)
        shutil.rmtree(path, ignore_errors=True)

    monkeypatch.setattr(docker_backend, "delete_subvolume", delete)
    return gone


def test_a_fork_whose_parent_cannot_be_resumed_leaves_no_fork_point(tmp_path, monkeypatch, deleted):
    monkeypatch.setattr(docker_backend, "snapshot_paused", lambda subvolume, point: point.mkdir())
    sandbox = _sandbox(tmp_path)
    point = tmp_path / "forks" / "sb-test-1"
    point.parent.mkdir()
    with pytest.raises(FailedPrecondition, match="could not resume"):
        asyncio.run(sandbox.fork_point(point))
    assert deleted == [point]
    assert not point.exists()


def test_a_teardown_that_fails_half_way_still_deletes_the_subvolume(tmp_path, monkeypatch, deleted):
    async def failing(self) -> None:
        raise OSError("the teardown failed")

    monkeypatch.setattr(ManagedSandbox, "destroy", failing)
    sandbox = _sandbox(tmp_path)
    subvolume = sandbox.subvolume
    sandbox.layer_dir = tmp_path / "engine-layer"  # detached: nothing is mounted there
    with pytest.raises(OSError, match="the teardown failed"):
        asyncio.run(sandbox.destroy())
    assert deleted == [subvolume] and sandbox.subvolume is None


def test_a_layer_the_engine_still_shows_keeps_its_subvolume(tmp_path, monkeypatch, deleted):
    async def failing(self) -> None:
        raise OSError("the teardown failed")

    monkeypatch.setattr(ManagedSandbox, "destroy", failing)
    sandbox = _sandbox(tmp_path)
    sandbox.layer_dir = Path("/")  # (a directory something is mounted on, as an attached layer is)
    with pytest.raises(OSError, match="the teardown failed"):
        asyncio.run(sandbox.destroy())
    assert deleted == [] and sandbox.subvolume is not None


class _Pool:
    """The node's btrfs pool, counting what the backend asks of it."""

    def __init__(self) -> None:
        self.opened = self.closed = self.reaped = 0

    def open(self) -> None:
        self.opened += 1

    def close(self) -> None:
        self.closed += 1

    def reap(self) -> None:
        self.reaped += 1


class _LateEngineBackend(DockerBackend):
    """A docker backend whose engine did not answer at the daemon's start and does now."""

    def probe(self) -> BackendStatus:
        return replace(self._status, available=True, detail="docker engine (test)")


def test_an_engine_that_comes_up_late_gets_the_pool_opened_once_and_closed(tmp_path):
    backend = _LateEngineBackend.__new__(_LateEngineBackend)
    backend._pool = ThreadPoolExecutor(1)
    backend.pool = _Pool()
    backend._pool_open = False
    backend._pool_opening = asyncio.Lock()
    backend._unreachable = True
    backend._status = BackendStatus(False, "cannot reach the Docker engine", "none", {})
    backend.client = None

    async def run() -> None:
        await asyncio.gather(backend.ensure_available(), backend.ensure_available())
        await backend.ensure_available()
        await backend.close()

    asyncio.run(run())
    pool = backend.pool
    assert (pool.opened, pool.reaped, pool.closed) == (1, 0, 1)
