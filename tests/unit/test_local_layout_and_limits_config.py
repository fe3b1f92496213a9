"""What a local sandbox's root is made of (root_layout, no root needed), and the configuration
keys that bound what sandboxes and TCP peers get."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.daemon.backends.base import BindMount
from corral.daemon.backends.local.launch import HOST_OS_ENTRIES, host_paths_over_own_mounts, root_layout
from corral.daemon.backends.root import RootMount as Mount
from corral.daemon.config import ConfigError, load_config


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A directory of this test's outside /tmp (host paths under /tmp are bound apart: below)."""
    path = Path(tempfile.mkdtemp(prefix="corral-layout-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_host_layout_is_the_os_and_the_allow_list_only(outside_tmp: Path):
    tmp_path = outside_tmp
    allowed = tmp_path / "data" / "shared"
    allowed.mkdir(parents=True)
    (allowed / "inner").mkdir()
    hidden = allowed / "state"
    hidden.mkdir()
    secret = allowed / "secret"
    layout = root_layout(
        "/", [str(hidden), "/nonexistent-state"], [str(allowed / "inner"), str(allowed)], [str(secret), "/srv/x"]
    )
    shown = {m.dst for m in layout if m.kind in ("overlay", "bind", "link")}
    assert shown - {f"/{e}" for e in HOST_OS_ENTRIES} == {str(allowed)}  # inner: already inside
    assert not shown & {"/home", "/root", "/srv", "/opt", "/var", "/mnt", "/tmp", "/proc"}
    parents = [m.dst for m in layout if m.kind == "dir"]
    # An empty home for root (not the host's), then the directories the allowed path needs.
    assert parents == ["/root", *(str(p) for p in reversed(allowed.parents) if str(p) != "/")]
    assert Mount("hide", "", str(hidden)) in layout  # hidden where it falls inside what is shown
    assert layout.index(Mount("bind", str(allowed), str(allowed))) > layout.index(Mount("dir", "", parents[-1]))
    # The OS directories are writable overlays; a secret is masked where it is shown, else left out.
    assert {m.dst for m in layout if m.kind == "overlay"} <= {f"/{e}" for e in HOST_OS_ENTRIES}
    assert [m.dst for m in layout if m.kind == "mask"] == [str(secret)]


def test_host_paths_under_the_sandboxs_own_tmp_are_bound_over_it_unless_they_hold_the_daemons_own(tmp_path: Path):
    shown, holding = tmp_path / "shown", tmp_path / "holding"
    (holding / "state").mkdir(parents=True)
    shown.mkdir()
    paths = [str(shown), str(holding)]
    layout = root_layout("/", [str(holding / "state")], paths, [])
    assert not {m.dst for m in layout} & set(paths)  # not in the root, where /tmp would cover them
    assert host_paths_over_own_mounts(paths, [str(holding / "state")]) == [BindMount(str(shown), str(shown), True)]
    assert host_paths_over_own_mounts(["/usr"], []) == []  # outside /tmp and /run: in the root


def test_directory_image_layout_is_one_writable_overlay(tmp_path: Path):
    (tmp_path / "usr").mkdir()
    layout = root_layout(str(tmp_path), ["/hidden"], ["/ignored-for-images"], ["/etc/shadow"])
    assert layout == [Mount("overlay", str(tmp_path), "/")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[local]\nhost_paths = ["relative/dir"]\n', "local.host_paths must hold absolute paths"),
        ('[local]\nhost_paths = ["/"]\n', "local.host_paths must hold absolute paths"),
        ("[local]\nshm_bytes = 1000\n", "local.shm_bytes must be at least 1 MiB"),
        ('[local]\nimage_cache_dir = "relative"\n', "local.image_cache_dir must be an absolute path"),
        ("[local]\nimage_cache_bytes = -1\n", "local.image_cache_bytes must be 0"),
        ("[daemon.tcp]\nmax_connections = 0\n", "daemon.tcp.max_connections must be at least 1"),
        ("[daemon.tcp]\nhandshake_timeout_s = 0\n", "daemon.tcp.max_connections must be at least 1"),
    ],
)
def test_bad_limits_are_refused_naming_the_key(tmp_path: Path, text: str, message: str):
    config = tmp_path / "corral.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(config, environ={})


def test_metrics_token_comes_from_its_file(tmp_path: Path):
    token = tmp_path / "token"
    config = tmp_path / "corral.toml"
    config.write_text(f'[metrics]\ntoken_file = "{token}"\n')
    token.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(config, environ={})
    token.write_text("m3trics\n")
    assert load_config(config, environ={}).metrics_token == "m3trics"
    (tmp_path / "bad.toml").write_text('metrics_token = "inline"\n')
    with pytest.raises(ConfigError, match="unknown configuration key metrics_token"):
        load_config(tmp_path / "bad.toml", environ={})
