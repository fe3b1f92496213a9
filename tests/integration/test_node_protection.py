"""What keeps sandboxes from starving the node, against a daemon each test starts on the local
backend: CPU weights in the sandbox's own cgroup and on the group of all sandboxes, admission
against the node's memory (daemon.memory_overcommit), and oom_score_adj for the daemon and for
sandbox processes. Each test looks only at its own daemon, its sandboxes and their cgroups."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from corral.daemon.admission import node_memory_bytes
from corral.daemon.cgroups import CgroupDriver
from corral.sdk import Client
from corral.sdk.errors import ResourceExhausted
from tests.conftest import DaemonProcess, cgroup_dirs, require_backend

MiB = 1 << 20
SANDBOX_MEMORY = 256 * MiB


def _start(tmp_path: Path, config: str = "") -> DaemonProcess:
    require_backend("local")
    extra: tuple[str, ...] = ()
    if config:
        (tmp_path / "corral.toml").write_text(config)
        extra = ("--config", str(tmp_path / "corral.toml"))
    return DaemonProcess(tmp_path, *extra).start()


@pytest.fixture
def daemon_with(tmp_path):
    """Starts a daemon with the given corral.toml text; stops it afterwards."""
    started: list[DaemonProcess] = []

    def start(config: str = "") -> DaemonProcess:
        started.append(_start(tmp_path, config))
        return started[-1]

    yield start
    for d in started:
        d.stop()


def _cpu_base(daemon_id: str) -> tuple[int, Path]:
    """(cgroup version, base directory) of that daemon's hierarchy with the cpu controller (see
    conftest.cgroup_dirs for where a child daemon's base lies)."""
    for h in CgroupDriver(daemon_id, create=False).hierarchies:
        if "cpu" not in h.controllers:
            continue
        for base in (h.base, h.base.parent.parent / h.base.name):
            if base.is_dir():
                return h.version, base
    pytest.skip("no writable cgroup hierarchy with the cpu controller here")


def _weight(version: int, group: Path) -> int:
    """A group's CPU weight on cgroup v2's scale (v1: cpu.shares / 10.24)."""
    if version == 1:
        return round(int((group / "cpu.shares").read_text()) / 10.24)
    return int((group / "cpu.weight").read_text())


def test_sandboxes_get_the_default_cpu_weight_and_their_group_a_lower_one(daemon_with) -> None:
    d = daemon_with()
    with Client(d.address) as c:
        version, base = _cpu_base(c.node_info().daemon_id)
        assert _weight(version, base) == 50  # daemon.sandboxes_cpu_weight: below the node's 100
        with c.create_sandbox() as sb:
            assert _weight(version, base / sb.id) == 100  # limits.cpu_weight


def test_configured_cpu_weight_reaches_the_sandbox_cgroup(daemon_with) -> None:
    d = daemon_with("[limits]\ncpu_weight = 300\n[daemon]\nsandboxes_cpu_weight = 20\n")
    with Client(d.address) as c:
        version, base = _cpu_base(c.node_info().daemon_id)
        assert _weight(version, base) == 20
        with c.create_sandbox() as sb:
            assert _weight(version, base / sb.id) == 300


def test_daemon_and_sandbox_processes_get_their_oom_score_adj(daemon_with) -> None:
    d = daemon_with("[daemon]\noom_score_adj = -300\n[limits]\noom_score_adj = 700\n")
    daemon_score = Path(f"/proc/{d.proc.pid}/oom_score_adj").read_text().strip()
    if _may_lower_oom_score():
        assert daemon_score == "-300"
    else:  # no CAP_SYS_RESOURCE here (a container): the daemon says so and serves on
        assert daemon_score == "0"
        assert (
            "keeps its inherited oom_score_adj (daemon.oom_score_adj = -300 needs CAP_SYS_RESOURCE)"
            in d.log.read_text()
        )
    with Client(d.address) as c, c.create_sandbox() as sb:
        result = sb.exec(["cat", "/proc/self/oom_score_adj"])
        assert result.stdout.decode().strip() == "700"
        if _may_lower_oom_score():
            # Set with CAP_SYS_RESOURCE, the score is also the floor: the sandbox's uid cannot
            # take it back down.
            lowered = sb.exec(["sh", "-c", "echo 0 > /proc/self/oom_score_adj"])
            assert lowered.exit_code != 0


def _may_lower_oom_score() -> bool:
    """Whether a process of ours may lower its oom_score_adj (CAP_SYS_RESOURCE), tried in a child."""
    done = subprocess.run(["sh", "-c", "echo -1 > /proc/self/oom_score_adj"], capture_output=True)
    return done.returncode == 0


def test_memory_admission_refuses_past_the_overcommit_and_frees_on_destroy(daemon_with) -> None:
    # Room for two sandboxes of SANDBOX_MEMORY, not three.
    factor = 2.5 * SANDBOX_MEMORY / node_memory_bytes()
    d = daemon_with(f"[daemon]\nmemory_overcommit = {factor!r}\n")
    with Client(d.address) as c:
        daemon_id = c.node_info().daemon_id
        first = c.create_sandbox(memory_bytes=SANDBOX_MEMORY)
        second = c.create_sandbox(memory_bytes=SANDBOX_MEMORY)
        try:
            with pytest.raises(ResourceExhausted, match="memory_overcommit"):
                c.create_sandbox(memory_bytes=SANDBOX_MEMORY)
            # Refused before anything was made: no sandbox, no cgroup, no record.
            assert {sb.id for sb in c.list_sandboxes()} == {first.id, second.id}
            assert {p.name for p in cgroup_dirs(daemon_id)} == {first.id, second.id}
            records = {p.name for p in (d.state_dir / "records").iterdir()}
            assert records == {f"{first.id}.json", f"{second.id}.json"}
            first.destroy()
            third = c.create_sandbox(memory_bytes=SANDBOX_MEMORY)
            third.destroy()
        finally:
            for sb in (first, second):
                sb.destroy()


def test_sandbox_processes_get_the_default_oom_score_adj_on_every_backend(sandbox) -> None:
    """The conformance case's daemon runs with the defaults: limits.oom_score_adj = 500 for every
    process a sandbox runs, whatever the backend."""
    assert sandbox.exec(["cat", "/proc/self/oom_score_adj"]).stdout.decode().strip() == "500"
