"""Admission arithmetic against the node's memory, the CPU weight conversion to cgroup v1 and
Docker, and the configuration keys of node protection."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.daemon import doctor
from corral.daemon.admission import admit_memory, node_memory_bytes
from corral.daemon.cgroups import cpu_weight_file, v1_cpu_shares
from corral.daemon.config import ConfigError, load_config
from corral.sdk.errors import ResourceExhausted

GiB = 1 << 30
NODE = 24 * GiB


def test_admits_up_to_the_overcommit_and_not_past_it() -> None:
    held = [4 * GiB] * 11  # 44 GiB of limits on a 24 GiB node, factor 2: 48 GiB admitted
    admit_memory(held, 4 * GiB, NODE, 2.0)  # 48: exactly at capacity
    with pytest.raises(ResourceExhausted, match=r"daemon.memory_overcommit 2 x 24.00 GiB"):
        admit_memory([*held, 4 * GiB], 4 * GiB, NODE, 2.0)


def test_thousand_default_sandboxes_are_not_admitted_on_a_small_node() -> None:
    admitted: list[int] = []
    with pytest.raises(ResourceExhausted):
        for _ in range(1000):
            admit_memory(admitted, 4 * GiB, NODE, 2.0)
            admitted.append(4 * GiB)
    assert len(admitted) == 12


def test_a_sandbox_without_a_limit_counts_as_the_whole_node() -> None:
    admit_memory([0], 0, NODE, 2.0)
    with pytest.raises(ResourceExhausted):
        admit_memory([0, 0], 1, NODE, 2.0)


def test_overcommit_zero_admits_everything() -> None:
    admit_memory([64 * GiB] * 100, 64 * GiB, NODE, 0.0)


def test_node_memory_is_memtotal(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:        1 kB\n")
    assert node_memory_bytes(str(meminfo)) == NODE


def test_cpu_weight_on_each_cgroup_version_and_docker() -> None:
    assert cpu_weight_file(2, 50) == ("cpu.weight", "50")
    assert cpu_weight_file(1, 100) == ("cpu.shares", "1024")
    assert v1_cpu_shares(50) == 512
    assert v1_cpu_shares(1) == 10
    assert v1_cpu_shares(0) == 2  # the kernel's minimum


def _config(tmp_path: Path, text: str):
    path = tmp_path / "corral.toml"
    path.write_text(text)
    return load_config(path, environ={})


def test_defaults_protect_the_node(tmp_path: Path) -> None:
    config = load_config(environ={})
    assert config.daemon.memory_overcommit == 16.0
    # The rollout service's own defaults fit: 64 RUN sandboxes at the default limit on a 16 GiB node.
    node = 16 * 1024**3
    assert config.rollout.run_workers * config.limits.memory_bytes <= config.daemon.memory_overcommit * node
    # ...while a thousand of them on a 24 GiB node do not.
    assert 1000 * config.limits.memory_bytes > config.daemon.memory_overcommit * 24 * 1024**3
    assert config.daemon.oom_score_adj < 0 < config.limits.oom_score_adj
    assert 0 < config.daemon.sandboxes_cpu_weight < 100 == config.limits.cpu_weight


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[daemon]\nmemory_overcommit = -1.0\n", "daemon.memory_overcommit"),
        ("[daemon]\noom_score_adj = -1001\n", "daemon.oom_score_adj"),
        ("[limits]\noom_score_adj = 1001\n", "limits.oom_score_adj"),
        ("[limits]\ncpu_weight = 10001\n", "limits.cpu_weight"),
        ("[daemon]\nsandboxes_cpu_weight = -1\n", "daemon.sandboxes_cpu_weight"),
    ],
)
def test_out_of_range_values_are_refused_by_name(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        _config(tmp_path, text)


def test_doctor_reports_the_node_protection_it_would_apply() -> None:
    config = load_config(environ={})
    lines = "\n".join(doctor.protection_lines(config, may_lower_oom_score=False))
    assert "up to 16 x" in lines and "daemon.memory_overcommit" in lines
    assert "daemon -500 wanted, left at its inherited score here (no CAP_SYS_RESOURCE)" in lines
    assert "sandbox processes 500" in lines
    assert "all sandboxes 50, each sandbox 100" in lines
    assert "daemon -500;" in "\n".join(doctor.protection_lines(config, may_lower_oom_score=True))


def test_capabilities_are_read_from_capeff(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("CapPrm:\t000001ffffffffff\nCapEff:\t000001fffeffffff\n")
    assert not doctor.has_capability(doctor.CAP_SYS_RESOURCE, str(status))
    assert doctor.has_capability(0, str(status))
