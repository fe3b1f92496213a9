"""The [[pool]] entries and the [pools] section of corral.toml (daemon/config.py)."""

from __future__ import annotations

import pytest

from corral.daemon.config import ConfigError, PoolEntry, load_config


def _load(tmp_path, text: str):
    path = tmp_path / "corral.toml"
    path.write_text(text)
    return load_config(path, environ={})


def test_pool_entries_are_read_in_order_with_their_env(tmp_path) -> None:
    config = _load(
        tmp_path,
        '[pools]\nmax_starting = 4\n[[pool]]\nsize = 8\npids = 512\nenv = { A = "1" }\n'
        '[[pool]]\nname = "py"\nbackend = "docker"\nimage = "python:3.12"\nnetwork = true\n',
    )
    assert config.pools.max_starting == 4
    assert config.pool == [
        PoolEntry(name="pool0", size=8, pids=512, env={"A": "1"}),
        PoolEntry(name="py", backend="docker", image="python:3.12", network=True),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[pool]]\nlabels = { a = "b" }\n', "unknown configuration key pool\\[0\\].labels"),
        ("[[pool]]\nenv = { A = 1 }\n", "pool\\[0\\].env must be a table of strings"),
        ("[[pool]]\nsize = -1\n", "pool\\[0\\].size must be 0 or more"),
        ('[[pool]]\nname = "a"\n[[pool]]\nname = "a"\n', "pool\\[1\\].name must be unique"),
        ('[[pool]]\nbackend = "vm"\n', "pool\\[0\\].backend must be one of"),
        ('[[pool]]\nsize = "2"\n', "pool\\[0\\].size must be int"),
        ("pool = 3\n", "pool must be an array of tables"),
        ("[pools]\nmax_starting = 0\n", "pools.max_starting must be at least 1"),
        ("[pools]\nretry_initial_s = 5.0\nretry_max_s = 1.0\n", "pools.retry_initial_s must be positive"),
    ],
)
def test_malformed_pools_name_the_key(tmp_path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, text)
