"""The cgroup driver's bookkeeping, on plain directories standing in for cgroup hierarchies (no
root needed): command leaves are reused instead of left behind, a refused limit leaves no group,
and the tally of held directories stays true. The real hierarchies are tested by
tests/integration/test_lifecycle_faults.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from corral.daemon import cgroups
from corral.daemon.cgroups import CgroupDriver, CgroupGroup, Hierarchy, LeafPool


def _driver(tmp_path: Path) -> CgroupDriver:
    """A driver whose two "hierarchies" are directories under tmp_path."""
    driver = CgroupDriver("t", create=False)
    driver.hierarchies = [
        Hierarchy(2, tmp_path / "unified" / "corral-t", frozenset(), key=""),
        Hierarchy(1, tmp_path / "pids" / "corral-t", frozenset({"pids"}), key="pids"),
    ]
    for h in driver.hierarchies:
        h.base.mkdir(parents=True)
    return driver


def _sandbox_and_pool(tmp_path: Path) -> tuple[CgroupDriver, CgroupGroup, LeafPool]:
    """A driver, a sandbox group in it and the pool of its command leaves (named p1, p2, ...)."""
    driver = _driver(tmp_path)
    names = iter(f"p{n}" for n in range(1, 1000))
    return driver, driver.create("sb-1"), LeafPool(lambda: next(names))


def _dirs(driver: CgroupDriver) -> list[Path]:
    return sorted(p for h in driver.hierarchies for p in h.base.rglob("*") if p.is_dir())


def test_a_limit_the_kernel_refuses_leaves_no_group(tmp_path, monkeypatch) -> None:
    driver = _driver(tmp_path)
    write = cgroups._write

    def refuse_pids(path: Path, value: str) -> None:
        if path.name == "pids.max":
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        write(path, value)

    monkeypatch.setattr(cgroups, "_write", refuse_pids)
    with pytest.raises(OSError):
        driver.create("sb-1", pids=5_000_000)
    assert _dirs(driver) == []
    assert driver.held() == {"v2": 0, "v1:pids": 0}


def test_commands_reuse_their_leaves(tmp_path) -> None:
    driver, sandbox, pool = _sandbox_and_pool(tmp_path)
    for _ in range(200):  # one command after another: one leaf
        name = pool.take()
        pool.give_back(name, sandbox.leaf(name))
    assert sorted(p.name for p in _dirs(driver)) == ["p1", "p1", "sb-1", "sb-1"]
    assert driver.held() == {"v2": 2, "v1:pids": 2}


def test_a_leaf_with_processes_left_is_set_aside_until_they_are_gone(tmp_path) -> None:
    driver, sandbox, pool = _sandbox_and_pool(tmp_path)
    first = pool.take()
    leaf = sandbox.leaf(first)
    (leaf.paths[0] / "cgroup.procs").write_text("4242\n")  # a background child still in it
    pool.give_back(first, leaf)
    second = pool.take()
    assert second != first  # never shared with the first command's processes
    pool.give_back(second, sandbox.leaf(second))
    (leaf.paths[0] / "cgroup.procs").write_text("")  # the child is gone
    assert {pool.take(), pool.take()} == {first, second}


def test_idle_leaves_beyond_the_pool_are_removed(tmp_path) -> None:
    driver, sandbox, pool = _sandbox_and_pool(tmp_path)
    taken = [pool.take() for _ in range(LeafPool.POOL_SIZE + 5)]  # that many at once
    leaves = [sandbox.leaf(name) for name in taken]
    for name, leaf in zip(taken, leaves):
        pool.give_back(name, leaf)
    assert driver.held()["v1:pids"] == 1 + LeafPool.POOL_SIZE
    sandbox.remove()
    assert _dirs(driver) == [] and driver.held() == {"v2": 0, "v1:pids": 0}


def test_a_leaf_that_cannot_be_made_everywhere_is_not_left_half_made(tmp_path) -> None:
    driver = _driver(tmp_path)
    sandbox = driver.create("sb-1")
    (sandbox.paths[1] / "p1").write_text("")  # a file where the second directory should go
    with pytest.raises(FileExistsError):
        sandbox.leaf("p1")
    assert not (sandbox.paths[0] / "p1").exists()
    assert driver.held() == {"v2": 1, "v1:pids": 1}
    assert CgroupGroup([p / "p2" for p in sandbox.paths], driver.hierarchies).is_empty()


def test_a_group_is_removed_even_without_a_file_descriptor_left(tmp_path, monkeypatch) -> None:
    driver = _driver(tmp_path)
    sandbox = driver.create("sb-1")

    def no_descriptors(top, *args, **kwargs):
        return iter(())  # what os.walk yields when it cannot open `top` (EMFILE)

    monkeypatch.setattr(cgroups.os, "walk", no_descriptors)
    sandbox.remove()
    assert _dirs(driver) == [] and driver.held() == {"v2": 0, "v1:pids": 0}
