"""A drain outlives a daemon restart: the node stays out of service until it is undone (the
state directory's marker), on the fake backend."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.daemon.config import load_config
from corral.daemon.server import Daemon
from corral.daemon.testing import fake_backends
from corral.sdk import AsyncClient, errors


@contextlib.asynccontextmanager
async def daemon_on(root: Path) -> AsyncIterator[AsyncClient]:
    """A daemon on `root`'s socket and state directory (the same ones at each start), and a client."""
    config = load_config(environ={})
    config = dataclasses.replace(
        config,
        daemon=dataclasses.replace(config.daemon, socket=str(root / "corral.sock"), state_dir=str(root / "state")),
    )
    daemon = Daemon(config, backend_classes=fake_backends())
    try:
        await daemon.start()
        async with AsyncClient(f"unix://{daemon.socket_path}") as client:
            yield client
    finally:
        await daemon.stop()


async def test_a_restarted_daemon_goes_on_draining_until_undone(tmp_path: Path) -> None:
    async with daemon_on(tmp_path) as client:
        assert (await client.drain()).draining
    async with daemon_on(tmp_path) as client:
        info = await client.node_info()
        assert info.draining and info.empty
        with pytest.raises(errors.Unavailable, match="draining"):
            await client.create_sandbox()
        assert not (await client.drain(False)).draining
        await (await client.create_sandbox()).destroy()
    async with daemon_on(tmp_path) as client:
        assert not (await client.node_info()).draining
        await (await client.create_sandbox()).destroy()
