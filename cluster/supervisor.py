"""One node's corral daemon as a child process: started with its own socket, state directory and
configuration, watched, and started again when it exits (a restarted daemon reaps what the one
before left: daemon/sandboxes.py, recover), up to a bound.

The daemon is started by the watching thread with a parent-death signal, so if the process that
supervises it dies (its Ray worker is killed, its node's raylet goes), the daemon gets SIGTERM and
shuts down in order instead of running on unsupervised.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def serving(address: str, timeout: float = 1.0) -> bool:
    """Whether the daemon at a gRPC address ("unix:/path", "host:port") answers SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class DaemonSupervisor:
    """`corral serve` under `root` (root/corral.sock, root/state, root/daemon.log), restarted when
    it exits, at most `max_restarts` times, a second apart. With `tcp_host` it also listens on
    that host at a free port (the same one after a restart), with a fresh bearer token
    (root/token): what clients on other machines reach it by."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        config_text: str = "",
        *,
        tcp_host: str | None = None,
        max_restarts: int = 5,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket = self.root / "corral.sock"
        self.address = f"unix://{self.socket}"
        self.tcp_address: str | None = None
        self.token: str | None = None
        if tcp_host is not None:
            self.tcp_address = f"{f'[{tcp_host}]' if ':' in tcp_host else tcp_host}:{_free_port(tcp_host)}"
            self.token = secrets.token_hex(16)
            token_file = self.root / "token"
            token_file.write_text(self.token)
            token_file.chmod(0o600)
        self.log_path = self.root / "daemon.log"
        self.config = self.root / "corral.toml"
        self.config.write_text(config_text)
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.failure = ""  # why supervision gave up, once it has
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"corral-daemon-{self.root.name}", daemon=True)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Starts the daemon and waits until it serves (RuntimeError with its log if it cannot)."""
        self._thread.start()
        self._started.wait()
        if self.failure:
            raise RuntimeError(self.failure)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the daemon (SIGTERM: it destroys its sandboxes first) and the supervision."""
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._thread.join(timeout_s)

    def _watch(self) -> None:
        try:
            while not self._stopping.is_set():
                failure = self._launch()
                if self._stopping.is_set():
                    return
                if failure and not self._started.is_set():
                    self.failure = failure  # the first start: start() raises it
                    return
                if not failure:
                    assert self._proc is not None
                    code = self._proc.wait()
                    if self._stopping.is_set():
                        return
                    failure = f"the daemon exited ({code})"
                # A daemon that exited and a restart that did not come up both count as restarts.
                if self.restarts >= self.max_restarts:
                    self.failure = f"{failure}; not restarted again after {self.restarts} restarts"
                    _log.error("%s: %s", self.root, self.failure)
                    return
                self.restarts += 1
                _log.warning("%s: %s; restarting it (%d)", self.root, failure.splitlines()[0], self.restarts)
                self._stopping.wait(1.0)
        finally:
            self._started.set()

    def _launch(self) -> str:
        """Starts one daemon process from this (the watching) thread and waits until it serves;
        why it did not ("" once it serves, or when stopped meanwhile)."""
        command = [sys.executable, "-m", "corral.cli", "serve", "--socket", str(self.socket)]
        command += ["--state-dir", str(self.root / "state"), "--config", str(self.config)]
        if self.tcp_address is not None:
            command += ["--tcp", self.tcp_address, "--token-file", str(self.root / "token")]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            if self._proc.poll() is not None:
                break
            if self.socket.exists() and serving(f"unix:{self.socket}"):
                self._started.set()
                return ""
            time.sleep(0.05)
        if self._stopping.is_set():
            return ""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        tail = self.log_path.read_text(errors="replace")[-2000:]
        return f"the daemon under {self.root} did not start serving:\n{tail}"
