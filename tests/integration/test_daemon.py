"""The daemon process: lifecycle, health, reflection, TCP auth, shutdown, crash recovery, systemd."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from corral.sdk import Client, errors
from tests.conftest import DaemonProcess, alive_pids, cgroup_dirs, require_backend, sandbox_pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sandbox_lifecycle(client):
    sb = client.create_sandbox(labels={"job": "t1"})
    assert sb.info.state == "running" and sb.info.isolation in ("namespaces", "container")
    assert sb.info.workdir == "/workspace"
    assert sb.id in [s.id for s in client.list_sandboxes(labels={"job": "t1"})]
    assert client.get_sandbox(sb.id).id == sb.id
    sb.destroy()
    with pytest.raises(errors.SandboxNotFound):
        client.get_sandbox(sb.id)
    with pytest.raises(errors.SandboxNotFound):
        sb.exec(["true"], timeout=5)


@pytest.mark.above_backend
def test_socket_mode(daemon):
    assert (daemon.socket.stat().st_mode & 0o777) == 0o660


def test_node_info(client, backend):
    info = client.node_info()
    current = next(b for b in info.backends if b.backend == backend)
    assert current.available and info.default_backend == backend
    assert info.cgroup_mode in ("v1", "v2", "hybrid", "none")


@pytest.mark.above_backend
def test_reflection_lists_services(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"corral.v1.SandboxService", "grpc.health.v1.Health"} <= names


def test_tcp_needs_the_token(tmp_path):
    require_backend("local")
    port = _free_port()
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    d = DaemonProcess(tmp_path, "--tcp", f"127.0.0.1:{port}", "--token-file", str(token_file)).start()
    try:
        with Client(f"127.0.0.1:{port}") as anonymous:
            with pytest.raises(errors.Unauthenticated):
                anonymous.list_sandboxes()
        with Client(f"127.0.0.1:{port}", token="wrong") as wrong:
            with pytest.raises(errors.Unauthenticated):
                wrong.list_sandboxes()
        with Client(f"127.0.0.1:{port}", token="s3cret") as good:
            with good.create_sandbox(image="host") as sb:
                assert sb.exec(["echo", "tcp"], timeout=10).stdout == b"tcp\n"
        with Client(d.address) as local:  # the Unix socket needs no token
            assert local.list_sandboxes() == []
    finally:
        d.stop()


def test_named_tcp_tokens_are_callers_of_their_own(tmp_path):
    """daemon.tcp.tokens_file: each token its own identity over TCP (another's sandbox is
    NOT_FOUND), daemon.tcp.admins' names see everyone's, and the single token still works."""
    require_backend("local")
    port = _free_port()
    (tmp_path / "token").write_text("the-single-one\n")
    (tmp_path / "tokens").write_text("# name token\nalice a-secret-1\n\nbob b-secret-2\ncarol c-secret-3\n")
    config = tmp_path / "corral.toml"
    config.write_text(
        f'[daemon.tcp]\nlisten = "127.0.0.1:{port}"\ntoken_file = "{tmp_path / "token"}"\n'
        f'tokens_file = "{tmp_path / "tokens"}"\nadmins = ["carol"]\n'
    )
    d = DaemonProcess(tmp_path, env={"CORRAL_CONFIG": str(config)}).start()
    address = f"127.0.0.1:{port}"
    try:
        with (
            Client(address, token="a-secret-1") as alice,
            Client(address, token="b-secret-2") as bob,
            Client(address, token="c-secret-3") as carol,
            Client(address, token="the-single-one") as single,
        ):
            with alice.create_sandbox(image="host") as sb:
                assert [s.id for s in alice.list_sandboxes()] == [sb.id]
                assert bob.list_sandboxes() == [] and single.list_sandboxes() == []
                with pytest.raises(errors.NotFound):
                    bob.get_sandbox(sb.id)
                assert [s.id for s in carol.list_sandboxes()] == [sb.id]
                assert carol.get_sandbox(sb.id).exec(["echo", "seen"], timeout=10).stdout == b"seen\n"
            with Client(address, token="alice") as name_is_no_token, pytest.raises(errors.Unauthenticated):
                name_is_no_token.list_sandboxes()
            # What changes the node: not a named token's holder's, unless an admin's.
            with pytest.raises(errors.PermissionDenied, match="changes the node"):
                bob.rollouts.set_policy_version(3)
            carol.rollouts.set_policy_version(3)
            single.rollouts.set_policy_version(4)
    finally:
        d.stop()


def test_tcp_without_token_refuses_to_start(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "corral.cli",
            "serve",
            "--socket",
            str(tmp_path / "s.sock"),
            "--state-dir",
            str(tmp_path / "st"),
            "--tcp",
            f"127.0.0.1:{_free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "CORRAL_TOKEN": ""},
    )
    assert proc.returncode == 2 and "token" in proc.stderr


def test_sigterm_destroys_sandboxes_and_removes_socket(tmp_path):
    require_backend("local")
    d = DaemonProcess(tmp_path).start()
    with Client(d.address) as c:
        sbs = [c.create_sandbox(image="host") for _ in range(3)]
        for sb in sbs:
            sb.exec("sleep 1000 >/dev/null 2>&1 &", timeout=10)
        daemon_id = c.node_info().daemon_id
    pids = sandbox_pids(daemon_id)
    assert len(pids) >= 3  # the sleeps at least
    assert d.stop(signal.SIGTERM) == 0
    assert not d.socket.exists()
    assert not list((d.state_dir / "sandboxes").glob("*"))
    assert not cgroup_dirs(daemon_id)
    assert not alive_pids(pids)


def test_in_flight_call_finishes_within_grace(tmp_path):
    require_backend("local")
    d = DaemonProcess(tmp_path).start()
    import threading

    with Client(d.address) as c:
        sb = c.create_sandbox(image="host")
        result = {}
        t = threading.Thread(target=lambda: result.update(r=sb.exec("sleep 1; echo finished", timeout=30)))
        t.start()
        time.sleep(0.3)
        d.proc.send_signal(signal.SIGTERM)
        t.join(30)
    assert result["r"].stdout == b"finished\n"
    assert d.proc.wait(30) == 0


def test_crash_recovery_after_kill_9(tmp_path):
    require_backend("local")
    d = DaemonProcess(tmp_path).start()
    with Client(d.address) as c:
        daemon_id = c.node_info().daemon_id
        for _ in range(3):
            sb = c.create_sandbox(image="host")
            sb.exec("setsid sleep 1001 >/dev/null 2>&1 & sleep 1002 >/dev/null 2>&1 &", timeout=10)
            sb.write_file("leftover.txt", b"x")
    pids = sandbox_pids(daemon_id)
    assert len(pids) >= 6  # the two sleeps of each sandbox at least
    d.stop(signal.SIGKILL)
    assert list((d.state_dir / "sandboxes").iterdir())  # the crash left sandboxes behind
    d.start()  # same state dir: the new daemon reaps what the old one left
    try:
        with Client(d.address) as c:
            assert c.list_sandboxes() == []
            assert c.node_info().daemon_id == daemon_id
        assert not list((d.state_dir / "sandboxes").iterdir())
        assert not list((d.state_dir / "records").iterdir())
        assert not cgroup_dirs(daemon_id)
        assert not alive_pids(pids)
    finally:
        d.stop()


def test_sd_notify_ready(tmp_path):
    require_backend("local")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = tmp_path / "notify.sock"
    notify.bind(str(notify_path))
    notify.settimeout(20)
    d = DaemonProcess(tmp_path, env={"NOTIFY_SOCKET": str(notify_path)}).start()
    try:
        assert notify.recv(1024) == b"READY=1"
    finally:
        d.stop()
        notify.close()


@pytest.mark.above_backend
def test_second_daemon_on_same_socket_refused(daemon, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "corral.cli",
            "serve",
            "--socket",
            str(daemon.socket),
            "--state-dir",
            str(tmp_path / "other"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "another daemon" in proc.stderr
    assert daemon.serving()


@pytest.mark.above_backend
def test_idle_timeout_destroys_sandbox(client):
    sb = client.create_sandbox(idle_timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sb.id not in [s.id for s in client.list_sandboxes()]:
            return
        time.sleep(0.3)
    pytest.fail("idle sandbox was not destroyed")


@pytest.mark.above_backend
def test_cli_doctor_and_exec(daemon, tmp_path):
    env = {**os.environ, "CORRAL_SOCKET": str(daemon.socket)}
    cli = [sys.executable, "-m", "corral.cli"]
    doctor = subprocess.run([*cli, "doctor"], capture_output=True, text=True, timeout=30)
    assert doctor.returncode == 0 and "local: available" in doctor.stdout
    sid = subprocess.run(
        [*cli, "sandbox", "create"], capture_output=True, text=True, env=env, timeout=30
    ).stdout.strip()
    assert sid.startswith("sb-")
    ex = subprocess.run(
        [*cli, "exec", sid, "--", "sh", "-c", "echo cli; exit 4"], capture_output=True, env=env, timeout=30
    )
    assert ex.returncode == 4 and ex.stdout == b"cli\n"
    (tmp_path / "f.txt").write_text("copied")
    assert (
        subprocess.run([*cli, "cp", str(tmp_path / "f.txt"), f"{sid}:/workspace"], env=env, timeout=30).returncode == 0
    )
    assert (
        subprocess.run([*cli, "exec", sid, "--", "cat", "f.txt"], capture_output=True, env=env, timeout=30).stdout
        == b"copied"
    )
    ls = subprocess.run([*cli, "sandbox", "ls"], capture_output=True, text=True, env=env, timeout=30)
    assert sid in ls.stdout
    assert subprocess.run([*cli, "sandbox", "rm", sid], env=env, timeout=30).returncode == 0


def test_isolation_none_only_when_explicitly_allowed(tmp_path):
    require_backend("local")
    config = tmp_path / "none.toml"
    config.write_text('[local]\nisolation = "none"\n')
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "corral.cli",
            "serve",
            "--config",
            str(config),
            "--socket",
            str(tmp_path / "r.sock"),
            "--state-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2 and "allow_no_isolation" in refused.stderr
    config.write_text('[local]\nisolation = "none"\nallow_no_isolation = true\n')
    # Without a mount namespace the sandbox uid reaches its workspace through the host's real
    # path, so every directory above the state dir must be traversable (as /var/lib is).
    for parent in [tmp_path, *tmp_path.parents]:
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o011)
    d = DaemonProcess(tmp_path, "--config", str(config)).start()
    try:
        with Client(d.address) as c, c.create_sandbox(image="host") as sb:
            assert sb.info.isolation == "none"
            network = next(s for s in sb.info.limit_status if s.kind == "network")
            assert not network.enforced and "none" in network.reason
            r = sb.exec("id -u; pwd; cat /etc/shadow", timeout=10)
            uid, cwd = r.stdout.split()[:2]
            assert uid != b"0" and cwd.decode() == sb.info.workdir
            assert b"Permission denied" in r.stderr
            sb.write_file("f.txt", b"none")
            assert sb.exec(["cat", "f.txt"], timeout=10).stdout == b"none"
            # Shells work the same way without namespaces: state, interrupts, restarts.
            from corral.v1 import shell_pb2, shell_pb2_grpc

            with grpc.insecure_channel(f"unix:{d.socket}") as channel:
                shells = shell_pb2_grpc.ShellServiceStub(channel)
                shells.OpenShell(shell_pb2.OpenShellRequest(sandbox_id=sb.id), timeout=30)

                def run(cmd, timeout_ms=10_000):
                    return shells.RunInShell(
                        shell_pb2.RunInShellRequest(sandbox_id=sb.id, command=cmd, timeout_ms=timeout_ms), timeout=30
                    )

                run("cd /tmp; export N=1")
                assert run("pwd; echo $N; id -u").output == f"/tmp\n1\n{uid.decode()}\n".encode()
                timed = run("sleep 100; echo never", timeout_ms=500)
                assert timed.timed_out and b"never" not in timed.output and not timed.shell_restarted
                assert run("echo $N").output == b"1\n"
    finally:
        d.stop()


def test_prometheus_metrics_opt_in(tmp_path):
    require_backend("local")
    import urllib.request

    port = _free_port()
    d = DaemonProcess(tmp_path, "--metrics", f"127.0.0.1:{port}").start()
    try:
        with Client(d.address) as c, c.create_sandbox(image="host") as sb:
            sb.exec(["true"], timeout=10)
            sb.exec(["sleep", "5"], timeout=0.2)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "corral_sandboxes_live 1.0" in text
        assert 'corral_execs_total{backend="local"} 2.0' in text
        assert 'corral_exec_timeouts_total{backend="local"} 1.0' in text
        assert 'corral_rpc_seconds_count{code="OK",method="Exec"} 2.0' in text
    finally:
        d.stop()
