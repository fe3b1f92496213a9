"""The rollout pipeline on a node with little room: its rollouts wait for their own sandboxes to be
gone (however slowly they are torn down) instead of being refused by daemon.max_sandboxes, on a
real daemon in this process whose backend is the fake (corral.daemon.testing), taught to fork and
to tear sandboxes down slowly; and the room itself (rollout/room.py)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from corral.daemon.backends.base import ForkPoint, SandboxRuntime
from corral.daemon.config import Config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.server import Daemon
from corral.daemon.testing import FakeBackend, FakeSandbox
from corral.rollout.room import SandboxRoom
from corral.sdk import AsyncClient
from tests.rollout_tasks import call, repair_task, replay_server

# How long tearing a sandbox down takes: far longer than a start, a fork or a rollout here.
TEARDOWN_S = 0.5


class _SlowTeardownSandbox(FakeSandbox):
    async def destroy(self) -> None:
        await asyncio.sleep(TEARDOWN_S)
        await super().destroy()


class _SlowTeardownBackend(FakeBackend):
    """The fake backend whose sandboxes take TEARDOWN_S to destroy: the daemon counts each against
    max_sandboxes until then. It cannot fork (INIT once falls back to an INIT per rollout)."""

    sandbox_class = _SlowTeardownSandbox


class _ForkingSlowTeardownBackend(_SlowTeardownBackend):
    """The same with (empty) fork points: its children start as plain fake sandboxes."""

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        return ForkPoint(str(sandbox.record()["sandbox_id"]), "", 0)


def _config(max_sandboxes: int, **rollout: Any) -> Config:
    config = Config()
    config.daemon.max_sandboxes = max_sandboxes
    config.daemon.memory_overcommit = 0
    # No retries unless asked: a single refusal of the node filters a rollout.
    rollout = {"init_retries": 0, **rollout}
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, **rollout))


def _quick_tasks(count: int) -> list:
    return [repair_task(f"room-{i}", eval_command="true", solution=[call("submit")]) for i in range(count)]


@pytest.mark.parametrize(
    ("samples", "init_once", "backend", "max_sandboxes"),
    [
        # Room for one shared INIT: its set-up sandbox and its two children.
        (2, True, _ForkingSlowTeardownBackend, 3),
        # The same, on a backend that cannot fork: a rollout takes the set-up sandbox, the other
        # runs an INIT of its own.
        (2, True, _SlowTeardownBackend, 3),
        # Room for one rollout's sandbox.
        (1, False, _SlowTeardownBackend, 1),
    ],
    ids=["init-once", "init-once-fell-back", "init-each"],
)
async def test_rollouts_wait_for_their_own_sandboxes_teardown_instead_of_being_refused(
    samples: int, init_once: bool, backend: type[FakeBackend], max_sandboxes: int
) -> None:
    tasks = _quick_tasks(3)
    # Two INIT workers: without the pipeline's own count, both would start sandboxes at once.
    config = _config(max_sandboxes, init_workers=2, run_workers=2, eval_workers=2, init_once=init_once)
    async with embedded_daemon(config, backend_classes={"local": backend}) as address:
        async with AsyncClient(address) as client, replay_server(tasks) as server:
            await client.rollouts.register_llm(server.url)
            results = [result async for result in client.rollouts.stream(tasks, n=samples)]
    outcomes = collections.Counter((r.status, r.filter_reason) for r in results)
    assert outcomes == {("completed", None): len(tasks) * samples}, [r.error for r in results]
    if backend is _ForkingSlowTeardownBackend:
        assert all(r.init_shared_by == samples for r in results)
    assert all(r.init_fell_back for r in results) == (init_once and backend is _SlowTeardownBackend)
    # Later INITs waited for the first ones' sandboxes to be torn down: queued time, not INIT's.
    assert max(r.timings["init_queue"] for r in results) >= TEARDOWN_S


async def test_room_comes_back_from_rollouts_cancelled_while_they_wait_for_it(tmp_path: Path) -> None:
    tasks = _quick_tasks(6)
    config = _config(3, init_workers=2, run_workers=1, eval_workers=1)
    config.daemon.socket = str(tmp_path / "corral.sock")
    config.daemon.state_dir = str(tmp_path / "state")
    daemon = Daemon(config, backend_classes={"local": _ForkingSlowTeardownBackend})
    await daemon.start()
    room = daemon.rollouts.pipeline.room
    try:
        async with AsyncClient(f"unix://{daemon.socket_path}") as client, replay_server(tasks) as server:
            await client.rollouts.register_llm(server.url)
            async for result in client.rollouts.stream(tasks, n=2):
                assert result.completed, result.error
                # Room for one shared INIT at a time: by the first result, INITs wait for room.
                # Closing the stream cancels them, and the rollouts that hold sandboxes.
                assert room.waiting > 0
                break
    finally:
        await daemon.stop()
    assert room.held == 0 and room.waiting == 0


async def test_the_room_goes_in_turn_and_a_taker_that_never_fits_goes_alone() -> None:
    room = SandboxRoom(3)
    await room.take(2)
    big = asyncio.ensure_future(room.take(3))  # more than ever fits: once nothing is held
    small = asyncio.ensure_future(room.take(1))  # fits, but after the one before it
    await asyncio.sleep(0)
    assert not big.done() and not small.done() and room.waiting == 2
    room.give_back(2)
    await big
    assert room.held == 3 and not small.done()
    room.give_back(3)
    await small
    assert room.held == 1 and room.waiting == 0


async def test_a_taker_cancelled_while_it_waits_takes_nothing_and_lets_the_next_go() -> None:
    room = SandboxRoom(2)
    await room.take(2)
    first = asyncio.ensure_future(room.take(2))
    second = asyncio.ensure_future(room.take(1))
    await asyncio.sleep(0)
    room.give_back(1)  # room for `second`, not for `first`, which is ahead of it
    await asyncio.sleep(0)
    assert not second.done()
    first.cancel()
    await second
    assert first.cancelled() and room.held == 2 and room.waiting == 0
    room.take_now(1)  # past the limit: a shared INIT's late members
    assert room.held == 3


async def test_trying_takes_only_room_that_fits_now_and_nobody_waits_for() -> None:
    # (A clean evaluation's sandbox starts beside the agent's only when it fits.)
    room = SandboxRoom(2)
    assert room.try_take(1) and room.held == 1
    waiting = asyncio.ensure_future(room.take(2))
    await asyncio.sleep(0)
    assert not room.try_take(1) and room.held == 1  # it fits, but someone asked first
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert room.try_take(1) and not room.try_take(1) and room.held == 2
    assert SandboxRoom(0).try_take(100)


async def test_no_limit_never_waits() -> None:
    room = SandboxRoom(0)
    for _ in range(5):
        await room.take(100)
    assert room.held == 500


async def test_a_node_full_of_sandboxes_that_are_not_the_rollouts_still_refuses_them() -> None:
    """The room counts the rollouts' own sandboxes only: a sandbox created on the node directly
    fills it as before, and INIT's retries run out (sandbox_start)."""
    [task] = _quick_tasks(1)
    config = _config(1, init_retries=1)
    async with embedded_daemon(config, backend_classes={"local": FakeBackend}) as address:
        async with AsyncClient(address) as client, replay_server([task]) as server:
            await client.rollouts.register_llm(server.url)
            async with await client.create_sandbox():
                [result] = [result async for result in client.rollouts.stream([task])]
    assert (result.status, result.filter_reason) == ("filtered", "sandbox_start")
    assert "failed 2 times" in result.error and "daemon.max_sandboxes" in result.error
