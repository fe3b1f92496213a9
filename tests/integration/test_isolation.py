"""What a local sandbox cannot do, and the limits it enforces on this machine."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from tests.conftest import ROOT_INSIDE


def test_no_network_host_loopback_unreachable(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted = []

    def accept() -> None:
        try:
            accepted.append(listener.accept())
        except OSError:
            pass  # closed at the end of the test

    threading.Thread(target=accept, daemon=True).start()
    try:
        r = sandbox.exec(
            ["python3", "-c", f"import socket; s=socket.socket(); s.settimeout(2); s.connect(('127.0.0.1', {port}))"],
            timeout=20,
        )
        assert r.exit_code != 0, "the sandbox reached a listener on the host's loopback"
        assert not accepted
    finally:
        listener.close()


# Run inside a sandbox: connects to the host's listener on PORT, through the host's loopback
# (local and Apptainer sandboxes share the host's network) or, in a container on the engine's
# bridge network, through its default gateway (the host's side of the bridge).
CONNECT_TO_HOST = """
import socket, sys
host = "127.0.0.1"
if sys.argv[2] == "gateway":
    for line in open("/proc/net/route").read().splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000":
            host = socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
socket.create_connection((host, int(sys.argv[1])), 5)
print(host)
"""


def test_network_when_asked(client, backend):
    via = "gateway" if backend == "docker" else "loopback"
    listener = socket.socket()
    listener.bind(("0.0.0.0" if via == "gateway" else "127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        with client.create_sandbox(network=True) as sb:
            r = sb.exec(["python3", "-c", CONNECT_TO_HOST, str(port), via], timeout=20)
            assert r.exit_code == 0, r.stderr
            listener.settimeout(5)
            listener.accept()[0].close()
    finally:
        listener.close()


def test_host_processes_invisible(sandbox):
    r = sandbox.exec("ps -eo pid,args", timeout=10)
    lines = r.stdout.decode().splitlines()[1:]
    # Only the sandbox's own init (bwrap's pid 1 and its shell) and `ps` itself.
    assert len(lines) <= 3, lines
    assert "corral.cli serve" not in r.stdout.decode() and "-m pytest" not in r.stdout.decode()


def test_nothing_outside_is_writable(sandbox, backend):
    r = sandbox.exec(
        "for d in / /usr /etc /var /root /home /opt; do touch $d/corral-probe 2>/dev/null && echo WROTE $d; done; true",
        timeout=10,
    )
    if backend in ROOT_INSIDE or backend == "local":  # root inside writes its own copy-on-write root
        if backend != "local":  # (the host image has no /var, /root, /home or /opt to write in)
            assert r.stdout.count(b"WROTE") == 7
        assert not any(os.path.exists(f"{d}/corral-probe") for d in ("", "/usr", "/etc", "/var", "/root", "/opt"))
    else:
        assert b"WROTE" not in r.stdout
    assert sandbox.exec("touch /workspace/ok /tmp/ok", timeout=10).exit_code == 0


def test_not_root_and_no_shadow(sandbox, backend):
    if backend in ROOT_INSIDE:
        pytest.skip("root inside (tests/integration/test_container_root.py)")
    r = sandbox.exec("id -u; cat /etc/shadow", timeout=10)
    if backend == "local":
        # Root inside a user namespace whose ids are an unprivileged host id block.
        host_id = sandbox.exec(["cat", "/proc/self/uid_map"], timeout=10).stdout.split()[1]
        assert r.stdout.strip() == b"0" and int(host_id) > 0
    else:
        assert r.stdout.strip() != b"0"
    assert r.exit_code != 0 and b"Permission denied" in r.stderr


def test_daemon_socket_and_state_unreachable(daemon, sandbox):
    for path in (daemon.socket, daemon.state_dir):
        r = sandbox.exec(["ls", "-la", str(path)], timeout=10)
        assert str(path.name).encode() not in r.stdout or r.exit_code != 0
    r = sandbox.exec(
        ["python3", "-c", f"import socket; s=socket.socket(socket.AF_UNIX); s.connect({str(daemon.socket)!r})"],
        timeout=10,
    )
    assert r.exit_code != 0


def test_sandboxes_do_not_see_each_other(client):
    with client.create_sandbox() as a, client.create_sandbox() as b:
        a.exec("sleep 120 >/dev/null 2>&1 & echo x > /tmp/a-was-here", timeout=10).check()
        assert b"sleep 120" not in b.exec("ps -eo args", timeout=10).stdout
        assert b.exec("test -e /tmp/a-was-here", timeout=10).exit_code != 0


def _limit(sandbox, kind):
    return next(s for s in sandbox.info.limit_status if s.kind == kind)


def test_fork_bomb_stopped_by_pids_limit(client):
    with client.create_sandbox(pids=64) as sb:
        if not _limit(sb, "pids").enforced:
            pytest.skip(f"pids limit not enforced here: {_limit(sb, 'pids').reason}")
        # The shell keeps busy after the bomb so that the timeout, not an exit, ends the call: the
        # whole tree, every bomb process included, must die with it.
        r = sb.exec("bomb() { bomb | bomb & }; bomb; while :; do :; done", timeout=8)
        assert r.timed_out
        assert b"Resource temporarily unavailable" in r.stderr  # fork failed at the limit
        # The host survived, the sandbox still works, and nothing of the bomb is left.
        assert sb.exec(["echo", "alive"], timeout=20).stdout == b"alive\n"


def test_memory_hog_is_killed_with_clear_status(client):
    with client.create_sandbox(memory_bytes=64 << 20) as sb:
        if not _limit(sb, "memory").enforced:
            pytest.skip(f"memory limit not enforced here: {_limit(sb, 'memory').reason}")
        r = sb.exec(["python3", "-c", "x = bytearray(512 << 20); print(len(x))"], timeout=30)
        assert r.oom_killed and r.signal == 9 and r.exit_code == 137
        assert sb.exec(["echo", "alive"], timeout=10).stdout == b"alive\n"


def test_limits_are_reported(sandbox):
    kinds = {s.kind: s for s in sandbox.info.limit_status}
    assert kinds["wall_clock"].enforced
    assert kinds["network"].enforced
    for s in kinds.values():
        assert s.enforced or s.reason
