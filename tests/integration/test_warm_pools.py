"""Warm pools ([[pool]], daemon/pools.py) on the local backend, against daemons these tests start:
matching creates are served from the pool and cannot be told from fresh sandboxes, other creates
start cold, the pool refills under pools.max_starting, a pool whose image is broken backs off,
pooled sandboxes are not listed, and they are destroyed at shutdown and reaped after a crash.
Everything is observed through the daemon's own answers (GetNodeInfo, its metrics) and, for
teardown, through the test daemon's own cgroups, processes and state records."""

from __future__ import annotations

import re
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from corral.daemon.backends.docker.backend import LABEL_DAEMON
from corral.sdk import Client
from corral.sdk.errors import InvalidArgument
from tests.conftest import (
    DOCKER_TEST_IMAGE,
    DaemonProcess,
    alive_pids,
    cgroup_dirs,
    require_backend,
    require_image,
    sandbox_pids,
)

POOL_SIZE = 22
MAX_STARTING = 2
# The shape the "warm" pool prepares: a request must ask for exactly this to be served from it.
WARM: dict[str, Any] = {"pids": 777, "env": {"POOL_TEST": "warm"}}
BROKEN_IMAGE = "/nonexistent/rootfs-of-test_warm_pools"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(port: int, name: str, pool: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf'^{name}\{{pool="{pool}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _start(root: Path, config: str) -> DaemonProcess:
    require_backend("local")
    (root / "corral.toml").write_text("[daemon]\nmemory_overcommit = 0.0\n" + config)
    return DaemonProcess(root, "--config", str(root / "corral.toml")).start()


class PoolDaemon:
    def __init__(self, root: Path) -> None:
        self.port = _free_port()
        self.process = _start(
            root,
            f'[metrics]\nlisten = "127.0.0.1:{self.port}"\n'
            f"[pools]\nmax_starting = {MAX_STARTING}\nretry_initial_s = 0.25\nretry_max_s = 1.0\n"
            f'[[pool]]\nname = "warm"\nsize = {POOL_SIZE}\npids = {WARM["pids"]}\n'
            'env = { POOL_TEST = "warm" }\n'
            f'[[pool]]\nname = "broken"\nsize = 2\nimage = "{BROKEN_IMAGE}"\n',
        )
        self.client = Client(self.process.address)
        self.most_starting = 0  # the most pool starts GetNodeInfo ever showed at once

    def metric(self, name: str, pool: str) -> float:
        return _metric(self.port, name, pool)

    def pool(self, name: str):
        pools = self.client.node_info().pools
        self.most_starting = max(self.most_starting, sum(p.starting for p in pools))
        return next(p for p in pools if p.name == name)

    def wait_full(self, name: str = "warm", timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while (pool := self.pool(name)).ready < pool.size:
            assert time.monotonic() < deadline, f"pool {name} did not fill: {pool}"
            time.sleep(0.005)


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    d = PoolDaemon(tmp_path_factory.mktemp("warm-pools"))
    d.wait_full()
    yield d
    d.client.close()
    d.process.stop()


def _probe(sb) -> dict[str, str]:
    """What a caller can see inside a sandbox: its processes, files, environment, cwd and user."""
    # (bwrap's --args names the descriptor its arguments came in on: whichever the daemon had free.)
    commands = {
        "ps": "ps -eo user,args --no-headers | grep -v -e 'ps -eo' -e 'grep -v' -e sed -e sort"
        " | sed 's/--args [0-9]*/--args FD/' | sort",
        "tmp": "ls -A /tmp",
        "workspace": "ls -A .",
        "env": "env | grep -v -e '^_=' -e '^PWD=' -e '^SHLVL=' | sort",
        "cwd": "pwd",
        "user": "id",
    }
    return {name: sb.exec(cmd, check=True).stdout.decode() for name, cmd in commands.items()}


def test_matching_creates_are_served_from_the_pool_fast_and_refilled_within_max_starting(pools) -> None:
    hits = pools.metric("corral_pool_hits_total", "warm")
    taken, seconds = [], []
    for _ in range(20):
        began = time.perf_counter()
        taken.append(pools.client.create_sandbox(**WARM, labels={"test": "warm-fast"}))
        seconds.append(time.perf_counter() - began)
    p50 = statistics.median(seconds)
    print(f"create from the warm pool at the SDK: p50 {p50 * 1000:.2f} ms, max {max(seconds) * 1000:.2f} ms")
    assert pools.metric("corral_pool_hits_total", "warm") == hits + 20
    assert p50 < 0.05, "a pool hit starts nothing: it is one round trip"
    assert all(sb.exec("echo ok").stdout == b"ok\n" for sb in taken)
    for sb in taken:
        sb.destroy()
    pools.wait_full()  # refilled up to its size, and no further
    assert pools.pool("warm").ready == POOL_SIZE
    assert pools.most_starting == MAX_STARTING  # starts overlapped, never more than allowed
    assert pools.metric("corral_pool_depth", "warm") == POOL_SIZE


def _assert_same_but_id_and_time(pooled, fresh) -> None:
    """A pooled sandbox and a fresh one made from the same request: only the id and the created
    time differ, in what the daemon says of them and in what runs inside."""
    a, b = pooled.info, fresh.info
    assert a.id != b.id and re.fullmatch(r"sb-[0-9a-f]{12}", a.id)
    assert abs((a.created_at - b.created_at).total_seconds()) < 30  # the time it was taken
    for name in ("backend", "image", "state", "isolation", "limits", "limit_status", "network", "labels"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.workdir, a.idle_timeout, a.user, a.mounts) == (b.workdir, b.idle_timeout, b.user, b.mounts)
    assert _probe(pooled) == _probe(fresh)


def test_a_pooled_sandbox_cannot_be_told_from_a_fresh_one(pools, tmp_path) -> None:
    hits = pools.metric("corral_pool_hits_total", "warm")
    labels = {"test": "indistinguishable"}
    with pools.client.create_sandbox(**WARM, labels=labels, idle_timeout=600) as pooled:
        assert pools.metric("corral_pool_hits_total", "warm") == hits + 1
        fresh_daemon = _start(tmp_path, "")  # no pools at all: the reference
        try:
            with Client(fresh_daemon.address) as fresh_client:
                with fresh_client.create_sandbox(**WARM, labels=labels, idle_timeout=600) as fresh:
                    _assert_same_but_id_and_time(pooled, fresh)
        finally:
            fresh_daemon.stop()


def test_a_pooled_docker_sandbox_cannot_be_told_from_a_fresh_one(tmp_path) -> None:
    require_backend("docker")
    require_image("docker")
    request: dict[str, Any] = {"image": DOCKER_TEST_IMAGE, "backend": "docker", "pids": 777, "env": {"A": "1"}}
    port = _free_port()
    (tmp_path / "pool").mkdir()
    (tmp_path / "fresh").mkdir()
    pool_daemon = _start(
        tmp_path / "pool",
        f'[metrics]\nlisten = "127.0.0.1:{port}"\n[[pool]]\nname = "docker"\nsize = 1\nbackend = "docker"\n'
        f'image = "{DOCKER_TEST_IMAGE}"\npids = 777\nenv = {{ A = "1" }}\n',
    )
    fresh_daemon = _start(tmp_path / "fresh", "")
    try:
        _wait_ready(pool_daemon, 1)
        with Client(pool_daemon.address) as pool_client, Client(fresh_daemon.address) as fresh_client:
            daemon_id = pool_client.node_info().daemon_id
            with pool_client.create_sandbox(**request, labels={"test": "docker"}) as pooled:
                assert _metric(port, "corral_pool_hits_total", "docker") == 1
                with fresh_client.create_sandbox(**request, labels={"test": "docker"}) as fresh:
                    _assert_same_but_id_and_time(pooled, fresh)
            _wait_ready(pool_daemon, 1)  # refilled: a pooled container for shutdown to remove
            assert _containers(daemon_id)
    finally:
        pool_daemon.stop()
        fresh_daemon.stop()
    assert _containers(daemon_id) == []


def _containers(daemon_id: str) -> list[str]:
    """The Docker containers of that daemon (its label), stopped ones included."""
    listed = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={LABEL_DAEMON}={daemon_id}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout.split()


def test_a_create_the_pool_did_not_prepare_is_a_miss_and_starts_cold(pools) -> None:
    hits = pools.metric("corral_pool_hits_total", "warm")
    misses = pools.metric("corral_pool_misses_total", "none")
    requests: list[dict[str, Any]] = [
        {"pids": 778, "env": WARM["env"]},  # other limits
        {"pids": WARM["pids"], "env": {"POOL_TEST": "other"}},  # other env
        {**WARM, "network": True},
    ]
    for request in requests:
        with pools.client.create_sandbox(**request) as sb:
            assert sb.exec("echo $POOL_TEST", check=True).stdout.strip() == request["env"]["POOL_TEST"].encode()
    assert pools.metric("corral_pool_misses_total", "none") == misses + 3
    assert pools.metric("corral_pool_hits_total", "warm") == hits


def test_pooled_sandboxes_are_not_listed(pools) -> None:
    pools.wait_full()
    assert pools.client.list_sandboxes() == []
    assert pools.client.node_info().sandbox_count == 0
    with pools.client.create_sandbox(**WARM, labels={"test": "listed"}) as sb:
        assert [s.id for s in pools.client.list_sandboxes()] == [sb.id]


def test_a_failing_pool_backs_off_and_creates_still_work_cold(pools) -> None:
    before = pools.metric("corral_pool_start_failures_total", "broken")
    time.sleep(2.5)
    tries = pools.metric("corral_pool_start_failures_total", "broken") - before
    # 0.25 s doubling to 1 s between tries: 2-4 tries in 2.5 s (a pool that spun would make hundreds).
    assert 1 <= tries <= 5, tries
    assert pools.pool("broken").ready == 0
    misses = pools.metric("corral_pool_misses_total", "broken")
    with pytest.raises(InvalidArgument, match="not a directory"):
        pools.client.create_sandbox(BROKEN_IMAGE)  # its own shape: an empty pool, so a cold start
    assert pools.metric("corral_pool_misses_total", "broken") == misses + 1
    with pools.client.create_sandbox() as sb:
        assert sb.exec("echo cold", check=True).stdout == b"cold\n"


def _small_pool(root: Path) -> DaemonProcess:
    return _start(root, '[[pool]]\nname = "small"\nsize = 2\n')


def _wait_ready(daemon: DaemonProcess, count: int) -> None:
    with Client(daemon.address) as client:
        deadline = time.monotonic() + 30
        while client.node_info().pools[0].ready < count:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def _records(daemon: DaemonProcess) -> list[Path]:
    return sorted((daemon.state_dir / "records").glob("*.json"))


def test_shutdown_destroys_pooled_sandboxes(tmp_path) -> None:
    daemon = _small_pool(tmp_path)
    with Client(daemon.address) as client:
        daemon_id = client.node_info().daemon_id
    _wait_ready(daemon, 2)
    assert len(_records(daemon)) == 2  # pooled sandboxes have state records, as every sandbox
    pids = sandbox_pids(daemon_id)
    assert pids
    assert daemon.stop() == 0
    assert not alive_pids(pids)
    assert _records(daemon) == []


def test_a_crashed_daemons_pooled_sandboxes_are_reaped_at_its_next_start(tmp_path) -> None:
    daemon = _small_pool(tmp_path)
    with Client(daemon.address) as client:
        daemon_id = client.node_info().daemon_id
    _wait_ready(daemon, 2)
    pids = sandbox_pids(daemon_id)
    daemon.stop(signal.SIGKILL)
    assert len(_records(daemon)) == 2  # what the crashed daemon left for its next start
    restarted = _start(tmp_path, "")  # the same state directory, no pools now
    try:
        assert _records(restarted) == []
        assert not alive_pids(pids)
        assert not cgroup_dirs(daemon_id)
    finally:
        restarted.stop()
