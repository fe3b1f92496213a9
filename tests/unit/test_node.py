"""Node, the node-level calls (GetNodeInfo, Drain), on its own: over a SandboxManager on the fake
backend, with the rollout pipeline stood in for by a count of live rollouts. And what a drain
means for rollouts, on a whole daemon."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from corral.daemon.embedded import embedded_daemon
from corral.daemon.node import Node, version
from corral.daemon.state import StateStore
from corral.daemon.testing import fake_backends
from corral.sdk import AsyncClient
from corral.sdk.errors import FailedPrecondition, Unavailable
from tests.rollout_tasks import repair_task
from tests.unit.test_fake_daemon import config_in
from tests.unit.test_sandbox_managers import Managers, managers


class LiveRollouts:
    """The pipeline as the node sees it: how many rollouts are not finished."""

    def __init__(self) -> None:
        self.live_count = 0


@pytest.fixture
async def parts(tmp_path) -> AsyncIterator[Managers]:
    async with managers(tmp_path) as parts:
        yield parts


@pytest.fixture
def rollouts() -> LiveRollouts:
    return LiveRollouts()


@pytest.fixture
def node(parts: Managers, rollouts: LiveRollouts) -> Node:
    return Node(parts.config, parts.state.daemon_id, parts.backends, parts.cgroups, parts.sandboxes, rollouts)


async def test_a_node_is_empty_without_sandboxes_and_unfinished_rollouts(node, parts, rollouts) -> None:
    assert node.empty()
    sandbox = await parts.create()
    assert not node.empty()
    await parts.sandboxes.destroy(sandbox.sandbox_id)
    assert node.empty()
    rollouts.live_count = 1
    assert not node.empty()


async def test_a_drained_node_refuses_sandboxes_until_undone(node, parts, tmp_path) -> None:
    assert await node.drain(True) == (True, True)
    assert StateStore(tmp_path / "state").draining  # kept for the next start
    with pytest.raises(Unavailable, match="this node is draining"):
        await parts.create()
    assert await node.drain(False) == (False, True)
    assert not StateStore(tmp_path / "state").draining
    await parts.create()


async def test_drain_says_whether_the_node_is_empty(node, parts, rollouts) -> None:
    sandbox = await parts.create()
    assert await node.drain(True) == (True, False)  # a drain keeps what runs
    assert parts.sandboxes.list() == [sandbox]
    await parts.sandboxes.destroy(sandbox.sandbox_id)
    rollouts.live_count = 2
    assert await node.drain(True) == (True, False)
    rollouts.live_count = 0
    assert await node.drain(True) == (True, True)


async def test_info_describes_the_node_and_what_it_holds(node, parts, rollouts) -> None:
    info = await node.info()
    assert (info.version, info.daemon_id, info.default_backend) == (version(), parts.state.daemon_id, "local")
    assert list(info.backends) == ["local"] and "FAKE BACKEND" in info.backends["local"].detail
    assert info.cgroup_mode == parts.cgroups.mode
    assert (info.sandbox_count, info.capacity.running, info.draining, info.empty) == (0, 0, False, True)
    assert info.capacity.max_sandboxes == 3 and info.pools == []

    await parts.create()
    rollouts.live_count = 1
    await node.drain(True)
    info = await node.info()
    assert (info.sandbox_count, info.capacity.running, info.draining, info.empty) == (1, 1, True, False)


async def test_a_drained_node_refuses_new_rollouts_until_undone(tmp_path) -> None:
    refusal = r"this node is draining: it takes no new rollouts \(submit them to another node\)$"
    async with embedded_daemon(config_in(tmp_path), backend_classes=fake_backends()) as address:
        async with AsyncClient(address) as client:
            await client.drain()
            with pytest.raises(Unavailable, match=refusal):
                await client.rollouts.run(repair_task("refused"))
            with pytest.raises(Unavailable, match=refusal):  # a Stream's submission, rejected in-band
                async for _ in client.rollouts.stream([repair_task("refused")]):
                    pass
            await client.drain(False)
            with pytest.raises(FailedPrecondition, match="no LLM server is registered"):  # taken: no LLM to run it
                await client.rollouts.run(repair_task("taken"))
