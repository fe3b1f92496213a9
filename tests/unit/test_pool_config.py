"""The [[pool]] entries and the [pools] section of corral.toml (daemon/config.py), and warm pools
on the fake backend (daemon/pools.py)."""

from __future__ import annotations

import asyncio

import pytest

from corral.daemon.config import Config, ConfigError, PoolEntry, load_config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import fake_backends
from corral.sdk import AsyncClient


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


def test_a_pool_the_node_cannot_make_stops_the_daemon_at_start() -> None:
    config = Config()
    config.pool = [PoolEntry(name="tiny", memory_bytes=1)]

    async def start() -> None:
        async with embedded_daemon(config, backend_classes=fake_backends()):
            pass

    with pytest.raises(ConfigError, match="pool tiny: limits.memory_bytes must be"):
        asyncio.run(start())


def test_a_hit_on_the_fake_backend_gets_the_callers_labels_and_the_pool_refills() -> None:
    """The pool's bookkeeping without root (the real backends: tests/integration/test_warm_pools.py)."""
    config = Config()
    config.daemon.memory_overcommit = 0
    config.pool = [PoolEntry(name="fake", size=2, env={"A": "1"})]

    async def run() -> None:
        async with embedded_daemon(config, backend_classes=fake_backends()) as address:
            async with AsyncClient(address) as client:
                while (await client.node_info()).pools[0].ready < 2:
                    await asyncio.sleep(0.01)
                assert await client.list_sandboxes() == []
                sb = await client.create_sandbox(env={"A": "1"}, labels={"who": "caller"})
                assert sb.info.labels == {"who": "caller"}
                assert [s.id for s in await client.list_sandboxes()] == [sb.id]
                while (pool := (await client.node_info()).pools[0]).ready < 2:
                    assert pool.ready + pool.starting <= 2
                    await asyncio.sleep(0.01)
                assert (await sb.exec("echo $A", check=True)).stdout == b"1\n"

    asyncio.run(run())


def test_pooled_sandboxes_are_not_reaped_for_idleness_while_they_wait() -> None:
    config = Config()
    config.daemon.memory_overcommit = 0
    config.limits.idle_timeout_s = 0.3  # every sandbox's default
    config.pool = [PoolEntry(name="fake", size=1)]

    async def run() -> None:
        async with embedded_daemon(config, backend_classes=fake_backends()) as address:
            async with AsyncClient(address) as client:
                while (await client.node_info()).pools[0].ready < 1:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(1.5)  # past the idle timeout and the reaper's sweeps
                pool = (await client.node_info()).pools[0]
                assert (pool.ready, pool.starting) == (1, 0)
                sb = await client.create_sandbox()
                assert (await sb.exec("echo alive", check=True)).stdout == b"alive\n"  # its idle time starts now

    asyncio.run(run())
