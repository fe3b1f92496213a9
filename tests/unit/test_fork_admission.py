"""ForkSandbox through the node's admission (drain, [admission] pace caps, leases), on the fake
backend taught to fork: its children start as plain fake sandboxes (the files are not copied;
tests/integration/test_fork.py tests that on the local backend). CreateGate's counts are tested
in test_node_admission.py."""

from __future__ import annotations

import asyncio

import pytest

from corral.daemon.backends.base import ForkPoint, SandboxRuntime, SandboxSpec
from corral.daemon.config import Config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import FakeBackend
from corral.sdk import AsyncClient, errors


class _ForkingFakeBackend(FakeBackend):
    """The fake backend with fork points (empty ones) and children a quarter second slow to
    start, so a fork is still under way when a test looks."""

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        return ForkPoint(str(sandbox.record()["sandbox_id"]), "", 0)

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        if spec.fork is not None:
            await asyncio.sleep(0.25)
        return await super().create(spec)


def _config() -> Config:
    config = Config()
    config.daemon.memory_overcommit = 0
    return config


def test_a_draining_node_refuses_forks() -> None:
    async def run() -> None:
        async with embedded_daemon(_config(), backend_classes={"local": _ForkingFakeBackend}) as address:
            async with AsyncClient(address) as client:
                parent = await client.create_sandbox()
                await client.drain()
                with pytest.raises(errors.Unavailable, match="draining"):
                    await parent.fork(2)
                await client.drain(False)
                assert len(await parent.fork(2)) == 2

    asyncio.run(run())


def test_a_fork_spends_count_tokens_of_the_rate() -> None:
    config = _config()
    config.admission.max_creates_per_s = 0.1
    config.admission.create_burst = 3

    async def run() -> None:
        async with embedded_daemon(config, backend_classes={"local": _ForkingFakeBackend}) as address:
            async with AsyncClient(address) as client:
                parent = await client.create_sandbox()
                with pytest.raises(errors.ResourceExhausted, match="max_creates_per_s") as refused:
                    await parent.fork(3)  # two tokens left
                assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 5
                assert len(await parent.fork(2)) == 2
                with pytest.raises(errors.ResourceExhausted, match="max_creates_per_s"):
                    await client.create_sandbox()
                assert len(await client.list_sandboxes()) == 3

    asyncio.run(run())


class _HeldForkFakeBackend(_ForkingFakeBackend):
    """Children that start only once the test lets them (`children_may_start`): the fork is under
    way for as long as the test looks, however slow the machine."""

    children_may_start: asyncio.Event

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        if spec.fork is not None:
            await self.children_may_start.wait()
        return await FakeBackend.create(self, spec)


def test_a_forks_children_hold_start_slots_while_they_start() -> None:
    config = _config()
    config.admission.max_starting = 2

    async def run() -> None:
        _HeldForkFakeBackend.children_may_start = asyncio.Event()
        async with embedded_daemon(config, backend_classes={"local": _HeldForkFakeBackend}) as address:
            async with AsyncClient(address) as client:
                parent = await client.create_sandbox()
                fork = asyncio.ensure_future(parent.fork(3))  # more than max_starting: nothing else starts
                while len(await client.list_sandboxes()) < 4:
                    await asyncio.sleep(0.01)
                with pytest.raises(errors.ResourceExhausted, match="max_starting"):
                    await client.create_sandbox()
                _HeldForkFakeBackend.children_may_start.set()
                assert len(await fork) == 3
                await client.create_sandbox()  # the slots are free again

    asyncio.run(run())


def test_children_have_a_lease_only_when_the_fork_asks_for_one() -> None:
    async def run() -> None:
        async with embedded_daemon(_config(), backend_classes={"local": _ForkingFakeBackend}) as address:
            async with AsyncClient(address) as client:
                parent = await client.create_sandbox(lease_ttl_s=60)
                (unleased,) = await parent.fork(1)
                assert unleased.info.lease_ttl is None and unleased.info.lease_expires_at is None
                leased = await parent.fork(2, lease_ttl_s=30)
                assert [child.info.lease_ttl for child in leased] == [30, 30]
                assert all(child.info.lease_expires_at for child in leased)
                with pytest.raises(errors.InvalidArgument, match="lease_ttl_ms"):
                    await parent.fork(1, lease_ttl_s=0.01)  # under the 100 ms minimum
                assert len(await client.list_sandboxes()) == 4

    asyncio.run(run())


class _ChildCountingFakeBackend(_ForkingFakeBackend):
    """Forks whose children start at once, but for what `starting` does to the n-th (from 1)."""

    children_started = 0

    async def starting(self, n: int) -> None:
        pass

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        if spec.fork is not None:
            self.children_started += 1
            await self.starting(self.children_started)
        return await FakeBackend.create(self, spec)


class _HalfForkingFakeBackend(_ChildCountingFakeBackend):
    """Forks whose first child starts at once and whose others never finish starting (until
    their creation is cancelled)."""

    async def starting(self, n: int) -> None:
        if n > 1:
            await asyncio.Event().wait()


def test_a_cancelled_fork_leaves_no_child_behind() -> None:
    async def run() -> None:
        async with embedded_daemon(_config(), backend_classes={"local": _HalfForkingFakeBackend}) as address:
            async with AsyncClient(address) as client:
                parent = await client.create_sandbox()
                with pytest.raises(errors.DeadlineExceeded):
                    await parent.fork(3, timeout=1.0)  # one child up, two starting when it ends
                for _ in range(100):
                    if [sb.id for sb in await client.list_sandboxes()] == [parent.id]:
                        break
                    await asyncio.sleep(0.05)
                assert [sb.id for sb in await client.list_sandboxes()] == [parent.id]
                await client.create_sandbox()  # no start slot or table entry left taken

    asyncio.run(run())


class _ChildRefusingFakeBackend(_ChildCountingFakeBackend):
    """Forks whose second child the backend refuses to start (as apptainer's launch failing,
    or the engine's checks of one container)."""

    async def starting(self, n: int) -> None:
        if n == 2:
            raise errors.FailedPrecondition("this child's start was refused")


def test_only_a_backend_that_cannot_fork_answers_failed_precondition() -> None:
    async def run() -> None:
        async with embedded_daemon(_config(), backend_classes={"local": FakeBackend}) as address:
            async with AsyncClient(address) as client:
                parent = await client.create_sandbox()
                with pytest.raises(errors.FailedPrecondition, match="cannot fork"):
                    await parent.fork(2)
        async with embedded_daemon(_config(), backend_classes={"local": _ChildRefusingFakeBackend}) as address:
            async with AsyncClient(address) as client:
                parent = await client.create_sandbox()
                with pytest.raises(errors.Unavailable, match="this child's start was refused"):
                    await parent.fork(3)  # failed this once: no sign that the backend cannot fork
                assert [sb.id for sb in await client.list_sandboxes()] == [parent.id]
                assert len(await parent.fork(2)) == 2

    asyncio.run(run())
