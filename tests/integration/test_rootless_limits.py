"""Limits of the local backend without root (docs/local-backend.md, "Without root"): a daemon run
as an unprivileged user (test_rootless.py's helpers) holds each limit in a cgroup its user was
delegated, else by an rlimit standing in for it (daemon/backends/local/rlimits.py), the disk in
a capped tmpfs or by a watcher (diskwatch.py), and says which in GetNodeInfo and each sandbox's
limit_status. Each test asserts what the node's status claims, then that it holds.

The delegated case needs root to make the user a cgroup v2 subtree (as systemd's Delegate=yes
does: the directory and its cgroup.procs, cgroup.subtree_control and cgroup.threads given to the
user) and starts the daemon in it; it checks each controller the v2 hierarchy offers there and
skips, naming the reason, where there is no v2 hierarchy."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess
from tests.integration.rootless_daemons import RootlessDaemon, rootless_place

MiB = 1 << 20
# Forks until the kernel refuses (EAGAIN) or `limit` children live, prints how many, then lets
# its children go.
FORK_UNTIL_REFUSED = """
import os, sys, time
children = []
try:
    while len(children) < int(sys.argv[1]):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except BlockingIOError:
    pass
print(len(children))
for pid in children:
    os.kill(pid, 9)
"""


@pytest.fixture(scope="module")
def rootless() -> Iterator[RootlessDaemon]:
    with rootless_place() as place:
        yield place


@pytest.fixture(scope="module")
def limits_daemon(rootless) -> Iterator[DaemonProcess]:
    with rootless.running("limits") as daemon:
        yield daemon


@pytest.fixture
def client(limits_daemon):
    from corral.sdk import Client

    with Client(limits_daemon.address) as c:
        yield c


def _local_limits(client) -> dict:
    local = next(b for b in client.node_info().backends if b.backend == "local")
    assert local.available, local.detail
    return {limit.kind: limit for limit in local.limits}


def _v2_mount() -> Path | None:
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return Path(left.split()[4])
    return None


def test_every_limit_says_enforced_approximated_or_absent(client):
    limits = _local_limits(client)
    for kind in ("memory", "pids", "cpu", "disk"):
        limit = limits[kind]
        assert not (limit.enforced and limit.approximated), limit
        assert limit.reason or limit.enforced, limit
    for kind, rlimit in (("memory", "RLIMIT_AS"), ("disk", "RLIMIT_FSIZE")):
        assert limits[kind].enforced or (limits[kind].approximated and rlimit in limits[kind].mechanism), limits[kind]
    if not limits["pids"].enforced:
        # Per sandbox (its own user namespace) since Linux 5.14; left out before, saying why.
        assert limits["pids"].approximated == ("RLIMIT_NPROC" in limits["pids"].mechanism), limits["pids"]
    if not limits["cpu"].enforced:
        assert not limits["cpu"].approximated and "RLIMIT_CPU" in limits["cpu"].reason, limits["cpu"]


def test_memory_limit(client):
    limit = _local_limits(client)["memory"]
    with client.create_sandbox(image="host", memory_bytes=256 * MiB) as sb:
        assert sb.exec(["python3", "-c", f"b = bytearray({64 * MiB}); b[-1] = 1"], timeout=60).exit_code == 0
        over = sb.exec(
            ["python3", "-c", f"b = bytearray({512 * MiB}); b[::4096] = b'x' * {512 * MiB // 4096}"], timeout=60
        )
        assert over.exit_code != 0, over
        if limit.approximated:
            # Refused at allocation (the address space), in every process: commands and the init.
            assert b"MemoryError" in over.stderr, over
            for pid in ("self", "1"):
                line = sb.exec(f"grep 'Max address space' /proc/{pid}/limits", timeout=30).stdout.split()
                assert line[3:5] == [str(256 * MiB).encode()] * 2, line


def test_pids_limit_counts_per_sandbox(client):
    limit = _local_limits(client)["pids"]
    if not (limit.enforced or limit.approximated):
        pytest.skip(f"no pids limit on this node: {limit.reason}")
    with (
        client.create_sandbox(image="host", pids=256) as crowded,
        client.create_sandbox(image="host", pids=24) as capped,
    ):
        # Another sandbox of the same uid running more than `capped`'s limit does not count.
        crowded.exec("for i in $(seq 40); do sleep 600 & done", timeout=30)
        forked = capped.exec(["python3", "-c", FORK_UNTIL_REFUSED, "100"], timeout=60)
        assert forked.exit_code == 0, forked
        assert 8 <= int(forked.stdout) < 24, forked


# Writes 1 MiB at a time to the file argv[1] until argv[2] MiB or a failure, and prints the
# error's name (nothing when every write went through).
WRITE_UNTIL_REFUSED = """
import errno, sys
try:
    with open(sys.argv[1], 'wb') as fh:
        for _ in range(int(sys.argv[2])):
            fh.write(b'x' * (1 << 20))
            fh.flush()
except OSError as err:
    print(errno.errorcode[err.errno])
"""


def _disk_status(sandbox):
    return next(limit for limit in sandbox.refresh().limit_status if limit.kind == "disk")


def test_a_small_disk_cap_is_a_capped_tmpfs(client, limits_daemon):
    """A cap up to local.rootless_tmpfs_max_bytes: the root's writable layer, the workspace and
    /tmp together on a capped tmpfs, where a write past the cap fails with ENOSPC."""
    if not _local_limits(client)["disk"].enforced:
        pytest.skip(f"no capped tmpfs on this node: {_local_limits(client)['disk'].reason}")
    with client.create_sandbox(image="host", disk_bytes=32 * MiB) as sb:
        status = _disk_status(sb)
        assert status.enforced and "size-capped tmpfs" in status.mechanism, status
        # Under the cap everything works, and the three places draw on one cap.
        r = sb.exec(
            "head -c 10M /dev/zero > /tmp/a && head -c 10M /dev/zero > w && head -c 10M /dev/zero > /usr/c && echo ok",
            timeout=60,
        )
        assert r.stdout == b"ok\n", r
        for path in ("/tmp/big", "/workspace/big", "/opt-big"):
            failed = sb.exec(["python3", "-c", WRITE_UNTIL_REFUSED, path, "48"], timeout=60)
            assert failed.stdout.strip() == b"ENOSPC", (path, failed)
            sb.exec(["rm", "-f", path], timeout=30)
        # A shell's command that writes past it fails with ENOSPC (no signal), and the shell lives on.
        shell = sb.shell("main")
        turn = shell.run("head -c 40M /dev/zero > /tmp/other; echo rc=$?", timeout=60)
        assert b"No space left on device" in turn.output and turn.output.endswith(b"rc=1\n"), turn.output
        assert shell.run("rm /tmp/other /tmp/a w /usr/c && echo alive", timeout=30).output == b"alive\n"
        # Removing files gives the space back.
        again = sb.exec(["python3", "-c", WRITE_UNTIL_REFUSED, "/tmp/again", "24"], timeout=60)
        assert again.exit_code == 0 and again.stdout == b"", again
        # None of it is on the host's disk: the tmpfs covers the sandbox's directory only in the
        # sandbox's own mount namespace.
        assert not list((limits_daemon.state_dir / "sandboxes" / sb.id).rglob("again"))


def test_a_large_disk_cap_is_watched(rootless):
    """A cap above local.rootless_tmpfs_max_bytes: the daemon sums the sandbox's writable
    directories and, past the cap, kills its processes, saying so in the command's result; the
    sandbox lives on, and once under the cap again its commands run."""
    from corral.sdk import Client

    with (
        rootless.running("watched", config="[local]\nrootless_tmpfs_max_bytes = 0\n") as daemon,
        Client(daemon.address) as c,
    ):
        assert _local_limits(c)["disk"].approximated
        with c.create_sandbox(image="host", disk_bytes=32 * MiB) as sb:
            status = _disk_status(sb)
            assert status.approximated and "watcher" in status.mechanism, status
            assert sb.exec("head -c 20M /dev/zero > /tmp/a && sleep 3 && echo ok", timeout=60).stdout == b"ok\n"
            # Two files under RLIMIT_FSIZE each, past the cap together; the command then waits.
            r = sb.exec("head -c 20M /dev/zero > /usr/b; sleep 30; echo survived", timeout=60)
            assert r.disk_cap_killed and r.signal == 9 and not r.timed_out and b"survived" not in r.stdout, r
            assert sb.exec("rm /tmp/a /usr/b && sleep 3 && echo ok", timeout=60).stdout == b"ok\n"
            # A shell turn says so too; its shell was among the processes, and starts afresh.
            shell = sb.shell("main")
            shell.run("export KEPT=1")
            turn = shell.run("head -c 40M /dev/zero > /tmp/a; head -c 20M /dev/zero > /tmp/b; sleep 30", timeout=60)
            assert turn.disk_cap_killed and turn.shell_restarted and not turn.timed_out, turn
            assert shell.run("echo kept=$KEPT; rm /tmp/a /tmp/b", timeout=30).output == b"kept=\n"
            # One file past the cap is stopped at once by RLIMIT_FSIZE (SIGXFSZ, as under
            # `ulimit -f`), before any sum (removed at once, before the next one).
            r = sb.exec("head -c 40M /dev/zero > /tmp/big; echo rc=$?; rm /tmp/big", timeout=60)
            assert r.stdout == b"rc=153\n" and b"File size limit exceeded" in r.stderr, r


# -- a delegated cgroup v2 subtree ---------------------------------------------------------------


@pytest.fixture(scope="module")
def delegated(rootless) -> Iterator[Path]:
    """A cgroup v2 directory given to the daemon's user as systemd's Delegate=yes gives one, with
    the controllers the hierarchy's root already enables for its children (the test changes
    nothing of the host's own hierarchy)."""
    if os.geteuid() != 0:
        pytest.skip("delegating a cgroup to the daemon's user takes root")
    mount = _v2_mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy on this host")
    subtree = mount / f"corral-test-delegated-{secrets.token_hex(4)}"
    subtree.mkdir()
    user = rootless.user
    for path in (subtree, *(subtree / f for f in ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads"))):
        os.chown(path, user.pw_uid, user.pw_gid)
    try:
        yield subtree
    finally:
        _remove_cgroup_tree(subtree)


def _remove_cgroup_tree(top: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for path in sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda d: -len(d.parts)):
        while True:
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_delegated_cgroup(rootless, delegated):
    from corral.sdk import Client

    offered = set((delegated / "cgroup.controllers").read_text().split())
    daemon = rootless.start("delegated", cgroup=delegated)
    try:
        with Client(daemon.address) as c:
            limits = _local_limits(c)
            assert limits["wall_clock"].mechanism == "process group + cgroup kill", limits["wall_clock"]
            for kind in ("memory", "pids", "cpu"):
                assert limits[kind].enforced == (kind in offered), (kind, offered, limits[kind])
                if kind in offered:
                    assert limits[kind].mechanism == f"cgroup v2 {kind}"
            marker = f"{secrets.randbelow(10**6) + 10**6}"
            with c.create_sandbox(image="host", memory_bytes=256 * MiB, pids=64) as sb:
                (group,) = delegated.glob(f"corral-*/{sb.id}")
                if "memory" in offered:
                    assert (group / "memory.max").read_text() == f"{256 * MiB}\n"
                if "pids" in offered:
                    assert (group / "pids.max").read_text() == "64\n"
                # The cgroup reaches what a process group does not: a double fork's orphan.
                r = sb.exec(f"(sleep 2{marker} &) ; sleep 4{marker}", timeout=2)
                assert r.timed_out
                left = sb.exec(f"ps -eo args | grep '[s]leep [24]{marker}'", timeout=30)
                assert left.stdout == b"", left
    finally:
        daemon.stop()
