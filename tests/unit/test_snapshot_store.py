"""The bounded store of named snapshots (daemon/backends/snapshot_store.py), with the directory
copies of the singularity backend, and its setting."""

from __future__ import annotations

import shutil

import pytest

from corral.daemon.backends.snapshot_store import SnapshotStore
from corral.daemon.config import ConfigError, load_config
from corral.daemon.diskcap import disk_usage
from corral.sdk.errors import ResourceExhausted


def copy_of(root, name: str, size: int):
    point = root / name
    (point / "workspace").mkdir(parents=True)
    (point / "workspace" / "f").write_bytes(b"x" * size)
    return point


def test_the_store_counts_what_its_snapshots_take_and_refuses_past_its_bound(tmp_path):
    store = SnapshotStore("singularity.snapshot_store_bytes", 3 << 20, disk_usage, shutil.rmtree)
    first = copy_of(tmp_path, "first", 2 << 20)
    assert store.admit(first, "sb-1") >= 2 << 20
    second = copy_of(tmp_path, "second", 2 << 20)
    with pytest.raises(ResourceExhausted, match="singularity.snapshot_store_bytes"):
        store.admit(second, "sb-1")
    assert not second.exists() and first.exists()  # the refused one is deleted, nothing else
    store.drop(first)
    assert not first.exists()
    assert store.admit(copy_of(tmp_path, "third", 2 << 20), "sb-1") >= 2 << 20  # room again


def test_singularity_snapshot_store_setting_is_checked(tmp_path):
    assert load_config(None, environ={}).backend("singularity").snapshot_store_bytes == 64 << 30
    toml = tmp_path / "c.toml"
    toml.write_text("[singularity]\nsnapshot_store_bytes = 0\n")
    assert load_config(toml, environ={}).backend("singularity").snapshot_store_bytes == 0
    toml.write_text("[singularity]\nsnapshot_store_bytes = -1\n")
    with pytest.raises(ConfigError, match="singularity.*snapshot_store_bytes"):
        load_config(toml, environ={})
