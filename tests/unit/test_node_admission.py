"""Admission by pace (CreateGate), idempotency keys (IdempotentCreates), capacity detection and
arithmetic (daemon/capacity.py), the [admission]/[leases] keys, the SDK's retry hint, and drain
and admission with warm pools on the fake backend."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from corral.daemon.admission import CreateGate, RateRefused, StartsRefused
from corral.daemon.backends.base import Limits, SandboxRuntime, SandboxSpec
from corral.daemon.capacity import NodeResources, detect_resources, node_capacity
from corral.daemon.config import Config, ConfigError, PoolEntry, load_config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.idempotency import IdempotentCreates
from corral.daemon.server import Daemon
from corral.daemon.testing import FakeBackend, fake_backends
from corral.sdk import AsyncClient, RolloutResult, errors
from tests.rollout_tasks import repair_task, replay_server

GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- CreateGate ------------------------------------------------------------------------------------


def test_rate_bucket_refuses_past_its_burst_and_hints_when_a_token_returns() -> None:
    clock = Clock()
    gate = CreateGate(0, 4.0, 2, clock)
    for _ in range(2):
        gate.check_rate()
        gate.take()
    with pytest.raises(RateRefused, match="admission.max_creates_per_s") as refused:
        gate.check_rate()
    assert refused.value.retry_after_s == pytest.approx(0.25)
    clock.now += 0.25
    gate.check_rate()  # one token back


def test_a_refused_check_spends_nothing() -> None:
    clock = Clock()
    gate = CreateGate(0, 1.0, 1, clock)
    gate.check_rate()  # a check alone spends nothing either
    gate.check_rate()
    gate.take()
    for _ in range(3):
        with pytest.raises(RateRefused):
            gate.check_rate()
    clock.now += 1.0  # one token back, none owed for the refusals
    gate.check_rate()


def test_starts_are_capped_and_the_hint_follows_how_long_starts_take() -> None:
    clock = Clock()
    gate = CreateGate(1, 0.0, 0, clock)
    with gate.starting_slots():
        with pytest.raises(StartsRefused, match="admission.max_starting") as refused:
            gate.check_start()
        assert refused.value.retry_after_s == CreateGate.FIRST_START_S
        clock.now += 0.1
    gate.check_start()
    with gate.starting_slots(), pytest.raises(StartsRefused) as refused:
        gate.check_start()
    assert refused.value.retry_after_s == pytest.approx(0.8 * 1.0 + 0.2 * 0.1)


def test_no_caps_admit_everything() -> None:
    gate = CreateGate(0, 0.0, 0)
    for _ in range(1000):
        gate.check_rate()
        gate.check_start()
        gate.take()


def test_the_gate_counts_a_fork_as_count_creates_and_starts() -> None:
    clock = Clock()
    gate = CreateGate(2, 4.0, 4, clock)
    gate.check_rate(3)
    gate.take(3)
    with pytest.raises(RateRefused) as refused:
        gate.check_rate(2)  # one token left
    assert refused.value.retry_after_s == pytest.approx(0.25)
    with gate.starting_slots(2):
        assert gate.starting == 2
        with pytest.raises(StartsRefused, match="admission.max_starting"):
            gate.check_start(1)
    with gate.starting_slots(1), pytest.raises(StartsRefused, match="3 more would pass its 2"):
        gate.check_start(3)


def test_a_fork_larger_than_a_cap_passes_alone_and_its_excess_delays_the_next_creates() -> None:
    clock = Clock()
    gate = CreateGate(2, 4.0, 4, clock)
    gate.check_rate(10)  # a full bucket is enough
    gate.check_start(10)  # nothing else starting
    gate.take(10)
    with pytest.raises(RateRefused) as refused:
        gate.check_rate()
    assert refused.value.retry_after_s == pytest.approx((1 + 6) / 4.0)  # six tokens owed
    clock.now += 1.75
    gate.check_rate()


# -- IdempotentCreates -----------------------------------------------------------------------------


def test_concurrent_creates_with_one_key_share_one_result() -> None:
    made = []

    async def make() -> str:
        await asyncio.sleep(0.05)
        made.append(1)
        return f"sb-{len(made)}"

    async def run() -> None:
        keys: IdempotentCreates[str] = IdempotentCreates(600, lambda sb: True)
        results = await asyncio.gather(*(keys.create("k", ("req",), make) for _ in range(5)))
        assert {sb for sb, _ in results} == {"sb-1"} and sum(hit for _, hit in results) == 4
        assert await keys.create("k", ("req",), make) == ("sb-1", True)
        with pytest.raises(errors.FailedPrecondition, match="different CreateSandbox request"):
            await keys.create("k", ("other",), make)
        assert made == [1]

    asyncio.run(run())


def test_a_failed_create_forgets_its_key_and_a_gone_sandbox_frees_it() -> None:
    alive = {"sb-2"}
    attempts = []

    async def make() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise errors.Unavailable("engine down")
        return f"sb-{len(attempts)}"

    async def run() -> None:
        keys: IdempotentCreates[str] = IdempotentCreates(600, lambda sb: sb in alive)
        with pytest.raises(errors.Unavailable):
            await keys.create("k", (), make)
        await asyncio.sleep(0)  # (the done callback)
        assert await keys.create("k", (), make) == ("sb-2", False)
        alive.clear()
        assert await keys.create("k", (), make) == ("sb-3", False)

    asyncio.run(run())


def test_keys_are_forgotten_after_their_window() -> None:
    clock = Clock()

    async def make() -> object:
        return object()

    async def run() -> None:
        keys: IdempotentCreates[object] = IdempotentCreates(10, lambda sb: True, clock)
        first, _ = await keys.create("k", (), make)
        clock.now += 11
        second, hit = await keys.create("k", (), make)
        assert second is not first and not hit and len(keys) == 1

    asyncio.run(run())


def test_an_overlong_key_is_invalid() -> None:
    async def make() -> str:
        return "sb"

    keys: IdempotentCreates[str] = IdempotentCreates(600, lambda sb: True)
    with pytest.raises(errors.InvalidArgument, match="at most 128 characters"):
        asyncio.run(keys.create("k" * 129, (), make))


# -- capacity ------------------------------------------------------------------------------------


def _fake_node(tmp_path: Path, cgroup_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16777216 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line)
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text)
    return proc, cgroups


def test_detection_takes_the_tightest_cgroup_v2_limits(tmp_path) -> None:
    proc, cgroups = _fake_node(
        tmp_path,
        "0::/corral.slice/daemon.service\n",
        {
            "corral.slice/memory.max": str(4 * GIB),
            "corral.slice/daemon.service/memory.max": "max",
            "corral.slice/daemon.service/cpu.max": "150000 100000",
        },
    )
    found = detect_resources(proc, cgroups)
    assert found.memory_bytes == 4 * GIB
    assert found.cpu_millicores == min(1500, len(os.sched_getaffinity(0)) * 1000)


def test_detection_without_cgroup_limits_is_the_whole_node(tmp_path) -> None:
    proc, cgroups = _fake_node(tmp_path, "0::/\n", {"memory.max": "max", "cpu.max": "max 100000"})
    found = detect_resources(proc, cgroups)
    assert found.memory_bytes == 16 * GIB
    assert found.cpu_millicores >= 1000


def test_detection_reads_cgroup_v1(tmp_path) -> None:
    proc, cgroups = _fake_node(
        tmp_path,
        "5:memory:/daemon\n4:cpu,cpuacct:/daemon\n",
        {
            "memory/daemon/memory.limit_in_bytes": str(2 * GIB),
            "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
            "cpu,cpuacct/daemon/cpu.cfs_quota_us": "50000",
            "cpu,cpuacct/daemon/cpu.cfs_period_us": "100000",
        },
    )
    found = detect_resources(proc, cgroups)
    assert found.memory_bytes == 2 * GIB and found.cpu_millicores == 500


def test_capacity_sums_limits_and_counts_free_slots() -> None:
    capacity = node_capacity(
        live=[("running", Limits(GIB, 100, 500, GIB)), ("starting", Limits(2 * GIB, 100, 0, 0))],
        max_sandboxes=10,
        default_memory_bytes=GIB,
        resources=NodeResources(8 * GIB, 4000),
        node_memory=8 * GIB,
        overcommit=1.0,
        disk_free=123,
        images=["local:b", "docker:a"],
    )
    assert (capacity.running, capacity.starting, capacity.free_slots) == (1, 1, 8)
    assert capacity.memory_committed_bytes == 3 * GIB and capacity.memory_admitted_bytes == 8 * GIB
    assert capacity.free_slots_default_limits == 5  # 5 GiB of admission left at 1 GiB each
    assert capacity.cpu_committed_millicores == 500 and capacity.disk_committed_bytes == GIB
    assert capacity.images_cached == ("docker:a", "local:b")


# -- configuration and the SDK's hint ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[admission]\nmax_starting = -1\n", "admission.max_starting"),
        ("[admission]\nmax_creates_per_s = -0.5\n", "admission.max_starting"),
        ("[leases]\nmax_ttl_s = 0.5\n", "leases.max_ttl_s must be at least 1"),
    ],
)
def test_malformed_admission_keys_name_the_key(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "corral.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})


class _Refusal(grpc.RpcError):
    def __init__(self, trailing: tuple[tuple[str, str], ...]) -> None:
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "slow down"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def test_the_sdk_error_carries_the_retry_hint() -> None:
    error = errors.error_from_rpc(_Refusal((("retry-after-ms", "250"),)), address="unix:///x")
    assert isinstance(error, errors.ResourceExhausted) and error.retry_after_s == 0.25
    assert errors.error_from_rpc(_Refusal(()), address="unix:///x").retry_after_s is None  # type: ignore[attr-defined]


# -- on the fake backend -------------------------------------------------------------------------


def test_drain_empties_the_warm_pool_and_undrain_refills_it() -> None:
    config = Config()
    config.daemon.memory_overcommit = 0
    config.pool = [PoolEntry(name="fake", size=2)]

    async def run() -> None:
        async with embedded_daemon(config, backend_classes=fake_backends()) as address:
            async with AsyncClient(address) as client:
                await _pool_ready(client, 2)
                state = await client.drain()
                assert state.draining and state.empty
                await asyncio.sleep(0.3)  # no refill while draining
                pool = (await client.node_info()).pools[0]
                assert (pool.ready, pool.starting) == (0, 0)
                with pytest.raises(errors.Unavailable, match="draining"):
                    await client.create_sandbox()
                assert not (await client.drain(False)).draining
                await _pool_ready(client, 2)

    asyncio.run(run())


def test_a_pool_hit_counts_against_the_rate_but_not_as_a_start() -> None:
    config = Config()
    config.daemon.memory_overcommit = 0
    config.admission.max_creates_per_s = 0.5
    config.admission.create_burst = 1
    config.pool = [PoolEntry(name="fake", size=1)]

    async def run() -> None:
        async with embedded_daemon(config, backend_classes=fake_backends()) as address:
            async with AsyncClient(address) as client:
                await _pool_ready(client, 1)
                await client.create_sandbox()  # the hit spends the one token
                with pytest.raises(errors.ResourceExhausted, match="max_creates_per_s") as refused:
                    await client.create_sandbox()
                assert refused.value.retry_after_s is not None and 1.0 < refused.value.retry_after_s <= 2.0

    asyncio.run(run())


def test_rollouts_accepted_before_a_drain_still_get_their_sandboxes(tmp_path) -> None:
    """One INIT worker: the second rollout waits in the queue while the first one's setup runs,
    the node drains meanwhile, and the second still makes its sandbox and completes."""
    config = _config_in(tmp_path)
    config.rollout.init_workers = 1
    slow, queued = repair_task("slow"), repair_task("queued")
    slow.setup.commands.append("sleep 1")

    async def run() -> None:
        daemon = Daemon(config, backend_classes=fake_backends())
        await daemon.start()
        try:
            async with AsyncClient(f"unix://{daemon.socket_path}") as client, replay_server([slow, queued]) as server:
                await client.rollouts.register_llm(server.url)
                results = asyncio.ensure_future(_collect(client.rollouts.stream([slow, queued])))
                while daemon.rollouts.pipeline.live_count < 2 or len(daemon.manager) < 1:
                    await asyncio.sleep(0.01)
                assert len(daemon.manager) == 1  # the queued rollout has no sandbox yet
                assert (await client.drain()).draining
                done = await asyncio.wait_for(results, 30)
                assert sorted((r.task_id, r.status) for r in done) == [("queued", "completed"), ("slow", "completed")]
                assert (await client.node_info()).empty
        finally:
            await daemon.stop()

    asyncio.run(run())


def _config_in(tmp_path: Path) -> Config:
    config = load_config(environ={})
    config.daemon.socket, config.daemon.state_dir = str(tmp_path / "corral.sock"), str(tmp_path / "state")
    config.daemon.memory_overcommit = 0
    return config


async def _pool_ready(client: AsyncClient, ready: int) -> None:
    while (await client.node_info()).pools[0].ready < ready:
        await asyncio.sleep(0.01)


async def _collect(results: AsyncIterator[RolloutResult]) -> list[RolloutResult]:
    return [result async for result in results]


def test_the_pace_caps_leave_the_daemons_own_rollouts_to_its_init_workers(tmp_path) -> None:
    config = _config_in(tmp_path)
    config.admission.max_creates_per_s, config.admission.create_burst = 0.01, 1
    config.admission.max_starting = 1
    tasks = [repair_task(f"paced-{i}") for i in range(3)]

    async def run() -> None:
        async with embedded_daemon(config, backend_classes=fake_backends()) as address:
            async with AsyncClient(address) as client, replay_server(tasks) as server:
                await client.rollouts.register_llm(server.url)
                done = await asyncio.wait_for(_collect(client.rollouts.stream(tasks)), 30)
                assert [r.status for r in done] == ["completed"] * 3, [r.error for r in done]
                await client.create_sandbox()  # a caller's create still spends the one token
                with pytest.raises(errors.ResourceExhausted, match="max_creates_per_s"):
                    await client.create_sandbox()

    asyncio.run(run())


def test_leases_idempotent_hits_and_refusals_are_counted(tmp_path) -> None:
    config = _config_in(tmp_path)
    config.admission.max_creates_per_s, config.admission.create_burst = 0.01, 2  # the hit spends none

    def count(name: str, **labels: str) -> float:
        return daemon.metrics.registry.get_sample_value(name, labels) or 0.0

    daemon = Daemon(config, backend_classes=fake_backends())

    async def run() -> None:
        await daemon.start()
        try:
            async with AsyncClient(f"unix://{daemon.socket_path}") as client:
                leased = await client.create_sandbox(lease_ttl_s=0.2)
                await client.create_sandbox(idempotency_key="k")
                await client.create_sandbox(idempotency_key="k")
                with pytest.raises(errors.ResourceExhausted):
                    await client.create_sandbox()
                await client.drain()
                with pytest.raises(errors.Unavailable):
                    await client.create_sandbox()
                while leased.id in {s.id for s in await client.list_sandboxes()}:
                    await asyncio.sleep(0.05)
        finally:
            await daemon.stop()

    asyncio.run(run())
    assert count("corral_leases_expired_total") == 1
    assert count("corral_idempotent_hits_total") == 1
    assert count("corral_admission_refusals_total", reason="rate") == 1
    assert count("corral_admission_refusals_total", reason="draining") == 1


class _SlowFakeBackend(FakeBackend):
    """The fake backend, half a second slower to create a sandbox."""

    async def create(self, spec: SandboxSpec) -> SandboxRuntime:
        await asyncio.sleep(0.5)
        return await super().create(spec)


def test_a_retry_after_the_deadline_waits_for_the_create_under_way(tmp_path) -> None:
    async def run() -> None:
        config = _config_in(tmp_path)
        async with embedded_daemon(config, backend_classes={"local": _SlowFakeBackend}) as address:
            async with AsyncClient(address) as client:
                with pytest.raises(errors.DeadlineExceeded):
                    await client.create_sandbox(idempotency_key="retried", timeout=0.2)
                retried_at = datetime.now(UTC)
                sandbox = await client.create_sandbox(idempotency_key="retried")
                assert sandbox.info.created_at < retried_at  # made for the first call
                assert [s.id for s in await client.list_sandboxes()] == [sandbox.id]

    asyncio.run(run())
