"""cgroup v2 delegation where the daemon's group is the root of a cgroup namespace (a container's
group, which the container sees at /sys/fs/cgroup, as in deploy/k8s's DaemonSet): the daemon
leaves it for a `daemon` leaf before enabling controllers, as in any group but the hierarchy's
real root. Directories stand in for cgroupfs: the driver only reads and writes its files."""

from __future__ import annotations

from pathlib import Path

from corral.daemon.cgroups import CgroupDriver


def delegate(own_dir: Path) -> set[str]:
    driver = CgroupDriver.__new__(CgroupDriver)  # without detecting this host's cgroups
    driver.reasons = {}
    return driver._delegate_v2(own_dir, {"memory", "pids"})


def group(root: Path, *, real_root: bool) -> Path:
    root.mkdir()
    (root / "cgroup.procs").write_text("4242\n")
    (root / "cgroup.subtree_control").write_text("")
    if not real_root:  # the kernel has no cgroup.events in the hierarchy's root only
        (root / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    return root


def test_a_group_with_processes_moves_them_to_a_leaf_first(tmp_path: Path) -> None:
    own = group(tmp_path / "namespace-root", real_root=False)
    assert delegate(own) == {"memory", "pids"}
    assert (own / "daemon" / "cgroup.procs").read_text() == "4242"
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_the_real_root_keeps_its_processes(tmp_path: Path) -> None:
    own = group(tmp_path / "root", real_root=True)
    assert delegate(own) == {"memory", "pids"}
    assert not (own / "daemon").exists()
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"
