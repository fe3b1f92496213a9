"""The host ids sandboxes get: a block of INSIDE_ID_COUNT each, out of `[sandbox] uid_count` in all."""

from __future__ import annotations

import pytest

from corral.daemon.config import ConfigError, load_config
from corral.daemon.uids import UidPool
from corral.daemon.users import INSIDE_ID_COUNT
from corral.sdk.errors import ResourceExhausted


def test_each_sandbox_gets_a_block_of_its_own_until_they_run_out():
    pool = UidPool(1_000_000, 3 * INSIDE_ID_COUNT + 5)  # the 5 spare ids make no fourth block
    firsts = [pool.take() for _ in range(3)]
    assert firsts == [1_000_000 + n * INSIDE_ID_COUNT for n in range(3)]
    with pytest.raises(ResourceExhausted, match="all 3 blocks"):
        pool.take()
    pool.give_back(firsts[1])
    assert pool.take() == firsts[1]  # a block given back is handed out again
    pool.give_back(12345)  # never handed out: ignored
    with pytest.raises(ResourceExhausted):
        pool.take()


def test_a_pool_smaller_than_one_block_is_refused():
    with pytest.raises(ValueError, match=f"uid_count must be at least {INSIDE_ID_COUNT}"):
        UidPool(1_000_000, INSIDE_ID_COUNT - 1)


def test_a_config_too_small_for_one_block_is_refused_naming_the_key(tmp_path):
    config = tmp_path / "corral.toml"
    config.write_text("[sandbox]\nuid_count = 1000\n")
    with pytest.raises(ConfigError, match="sandbox.uid_count must be at least 65536"):
        load_config(config, environ={})
