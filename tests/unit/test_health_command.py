"""`corral health`, the probe of deploy/k8s and deploy/slurm: exit 0 only when the daemon answers
SERVING, over its Unix socket or over TCP with the bearer token; a daemon in this process on the
fake backend (no root), the command as a child process."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
from collections.abc import AsyncIterator

import pytest

from corral.daemon.config import load_config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import fake_backends

TOKEN = "health-test-token"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
async def daemon() -> AsyncIterator[tuple[str, str]]:
    """(Unix socket address, TCP address) of a daemon that also listens on loopback TCP."""
    config = load_config(environ={})
    tcp = f"127.0.0.1:{free_port()}"
    config = dataclasses.replace(
        config,
        token=TOKEN,
        daemon=dataclasses.replace(config.daemon, tcp=dataclasses.replace(config.daemon.tcp, listen=tcp)),
    )
    async with embedded_daemon(config, backend_classes=fake_backends()) as address:
        yield address, tcp


async def health(*args: str, token: str | None = None) -> tuple[int, str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("CORRAL_")}
    if token:
        env["CORRAL_TOKEN"] = token
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "corral.cli",
        "health",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_serving_daemon_is_healthy_on_its_socket_and_over_tcp_with_the_token(daemon) -> None:
    unix, tcp = daemon
    code, out, err = await health("--address", unix)
    assert code == 0 and out == f"{unix}: SERVING\n", err
    code, out, err = await health("--address", tcp, "--service", "corral.v1.SandboxService", token=TOKEN)
    assert code == 0 and out.endswith(": SERVING\n"), err


async def test_no_token_no_daemon_or_an_unknown_service_is_unhealthy(daemon, tmp_path) -> None:
    unix, tcp = daemon
    # The TCP listener checks the token on every call, health included: a probe that sends no
    # header (Kubernetes' own grpc probe) is refused, hence the exec probe of deploy/k8s.
    code, _, err = await health("--address", tcp)
    assert code == 1 and "UNAUTHENTICATED" in err
    code, _, err = await health("--address", tcp, token="wrong")
    assert code == 1 and "UNAUTHENTICATED" in err
    code, _, err = await health("--address", unix, "--service", "no.such.Service")
    assert code == 1 and "NOT_FOUND" in err
    code, _, err = await health("--address", str(tmp_path / "none.sock"), "--timeout", "2")
    assert code == 1 and "UNAVAILABLE" in err
