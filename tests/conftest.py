"""Shared fixtures: a real daemon process on a temporary socket, and backend requirements.

Backend-specific tests skip when the backend is missing on this machine, unless the environment
variable CORRAL_REQUIRE_BACKENDS (e.g. "local,docker,singularity") names it: then they fail, so CI
cannot pass by skipping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corral.daemon.config import load_config
from corral.daemon.doctor import probe

REQUIRED = {b.strip() for b in os.environ.get("CORRAL_REQUIRE_BACKENDS", "").split(",") if b.strip()}


def require_backend(name: str) -> None:
    """Skips (or, when CORRAL_REQUIRE_BACKENDS names the backend, fails) if it is unavailable."""
    _, statuses = probe(load_config(environ={}))
    status = statuses.get(name)
    if status and status.available:
        return
    reason = f"backend {name} unavailable: {status.detail if status else 'unknown backend'}"
    if name in REQUIRED:
        pytest.fail(f"{reason} (CORRAL_REQUIRE_BACKENDS={os.environ['CORRAL_REQUIRE_BACKENDS']})")
    pytest.skip(reason)


class DaemonProcess:
    """`corral serve` in a child process, with its own socket and state directory."""

    def __init__(self, root: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.socket = root / "corral.sock"
        self.state_dir = root / "state"
        self.address = f"unix://{self.socket}"
        self.extra = extra
        self.env = {**os.environ, **(env or {})}
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> "DaemonProcess":
        cmd = [sys.executable, "-m", "corral.sdk.cli", "serve", "--socket", str(self.socket),
               "--state-dir", str(self.state_dir), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.serving():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not become ready:\n{self.log.read_text()}")

    def serving(self) -> bool:
        if not self.socket.exists():
            return False
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture(scope="session", params=["bwrap", "unshare"])
def daemon(request, tmp_path_factory) -> DaemonProcess:
    """One daemon per local launcher for the whole session, so that every test using it runs on
    both bubblewrap and the unshare fallback (tests that kill or restart daemons make their own)."""
    require_backend("local")
    root = tmp_path_factory.mktemp(f"daemon-{request.param}")
    config = root / "corral.toml"
    config.write_text(f'[local]\nisolation = "{request.param}"\n')
    proc = DaemonProcess(root, "--config", str(config)).start()
    yield proc
    proc.stop()


@pytest.fixture
def client(daemon):
    from corral.sdk import Client

    with Client(daemon.address) as c:
        yield c


@pytest.fixture
def sandbox(client):
    with client.create_sandbox(image="host") as sb:
        yield sb
