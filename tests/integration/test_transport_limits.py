"""The daemon's listeners against hostile peers: TCP peers are bounded in number and time, the Unix
socket never has a wider mode than configured, and the metrics endpoint can require a token."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from corral.sdk import Client, errors
from tests.conftest import DaemonProcess, require_backend

# What an HTTP/2 client sends first: the connection preface and an empty SETTINGS frame.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b"" or _closed_by_peer(sock)
    except BlockingIOError:
        return False
    except OSError:  # reset (or refused: the server closed it before it was accepted)
        return True


def test_tcp_flood_is_bounded_and_the_unix_socket_keeps_answering(tmp_path: Path) -> None:
    require_backend("local")
    port = _free_port()
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "corral.toml").write_text(
        "[daemon.tcp]\nmax_connections = 32\nhandshake_timeout_s = 1\nidle_timeout_s = 2\n"
    )
    d = DaemonProcess(
        tmp_path,
        "--config",
        str(tmp_path / "corral.toml"),
        "--tcp",
        f"127.0.0.1:{port}",
        "--token-file",
        str(tmp_path / "token"),
    ).start()
    assert d.proc is not None
    idle: list[socket.socket] = []
    try:
        with Client(d.address) as local:
            # GetNodeInfo asks every backend (engine clients open their connections on first use):
            # the baseline is taken after both calls the test makes, so only the flood counts.
            local.list_sandboxes()
            local.node_info()
            baseline = _open_fds(d.proc.pid)
            # A bounded flood on loopback: 300 sockets that never say a word, and 8 that open
            # HTTP/2 and then make no call.
            for _ in range(300):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                idle.append(s)
            talkers = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
            for s in talkers:
                with contextlib.suppress(OSError):  # (refused once the limit is reached)
                    s.sendall(HTTP2_PREFACE)
                s.setblocking(False)
            flood_started = time.monotonic()
            time.sleep(0.3)
            # The daemon holds at most max_connections of them, and its Unix socket answers.
            assert _open_fds(d.proc.pid) <= baseline + 32 + 8
            t = time.monotonic()
            assert local.list_sandboxes() == [] and local.node_info().daemon_id
            assert time.monotonic() - t < 2
            # Every silent socket is closed by the handshake timeout (1 s), the HTTP/2 ones by the
            # idle timeout (2 s).
            pending = idle + talkers
            while pending and time.monotonic() - flood_started < 10:
                pending = [s for s in pending if not _closed_by_peer(s)]
                time.sleep(0.1)
            assert not pending, f"{len(pending)} idle sockets still open 10 s after they connected"
            assert _open_fds(d.proc.pid) <= baseline + 2
            for s in talkers:
                s.close()
        # Authenticated TCP callers get in once the flood is gone; a wrong token still does not.
        with Client(f"127.0.0.1:{port}", token="s3cret") as good:
            assert good.list_sandboxes() == []
        with Client(f"127.0.0.1:{port}", token="wrong") as wrong, pytest.raises(errors.Unauthenticated):
            wrong.list_sandboxes()
    finally:
        for s in idle:
            s.close()
        d.stop()


def test_unix_socket_never_has_a_wider_mode(tmp_path: Path) -> None:
    require_backend("local")
    d = DaemonProcess(tmp_path)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        # The first mode the socket file shows, from the moment it exists.
        while not stop.is_set():
            try:
                seen.append(os.lstat(d.socket).st_mode & 0o777)
                return
            except FileNotFoundError:
                continue

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        d.start()
    finally:
        stop.set()
        watcher.join()
    try:
        assert seen == [0o660], [oct(m) for m in seen]
    finally:
        d.stop()


def _scrape(port: int, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def test_metrics_can_require_a_token(tmp_path: Path) -> None:
    require_backend("local")
    port = _free_port()
    (tmp_path / "metrics-token").write_text("m3trics\n")
    (tmp_path / "corral.toml").write_text(f'[metrics]\ntoken_file = "{tmp_path / "metrics-token"}"\n')
    d = DaemonProcess(tmp_path, "--config", str(tmp_path / "corral.toml"), "--metrics", f"127.0.0.1:{port}").start()
    try:
        assert _scrape(port, None)[0] == 401
        assert _scrape(port, "wrong")[0] == 401
        status, text = _scrape(port, "m3trics")
        assert status == 200 and "corral_sandboxes_live" in text
    finally:
        d.stop()
