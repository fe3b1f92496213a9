"""Node capacity, leases, idempotent creates, admission control and drain, on the local backend.

Each test runs its own daemon (its own socket, state directory and configuration), since draining
and admission caps are the node's whole state.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.sdk import AsyncClient, Client, errors
from tests.conftest import DaemonProcess, alive_pids, require_backend, sandbox_pids
from tests.rollout_tasks import repair_task

MIB = 1 << 20


@pytest.fixture
def node(tmp_path: Path, request) -> Iterator[DaemonProcess]:
    """A local-backend daemon of its own; an indirect parameter adds to its corral.toml."""
    require_backend("local")
    config = tmp_path / "corral.toml"
    config.write_text("[daemon]\nmemory_overcommit = 0.0\n" + getattr(request, "param", ""))
    proc = DaemonProcess(tmp_path, "--config", str(config)).start()
    yield proc
    proc.stop()


def _wait_gone(client: Client, sandbox_id: str, timeout: float) -> float:
    """Seconds until the sandbox is gone (fails past `timeout`)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        try:
            client.get_sandbox(sandbox_id)
        except errors.SandboxNotFound:
            return time.monotonic() - began
        time.sleep(0.1)
    raise AssertionError(f"sandbox {sandbox_id} still exists after {timeout} s")


def test_lease_expiry_destroys_only_its_sandbox(node):
    with Client(node.address) as client:
        leased = client.create_sandbox(lease_ttl_s=1.0)
        kept = client.create_sandbox()
        assert leased.info.lease_ttl == 1.0 and leased.info.lease_expires_at is not None
        assert kept.info.lease_ttl is None
        _wait_gone(client, leased.id, timeout=5)
        assert kept.exec(["true"], timeout=5).exit_code == 0
        assert client.node_info().capacity.running == 1
        kept.destroy()


def test_renew_keeps_the_sandbox_past_its_first_ttl(node):
    with Client(node.address) as client:
        sandbox = client.create_sandbox(lease_ttl_s=1.0)
        first_expiry = sandbox.info.lease_expires_at
        for _ in range(4):  # 2 s in all: twice the first TTL
            time.sleep(0.5)
            sandbox.renew_lease(1.0)
        assert sandbox.info.lease_expires_at is not None and first_expiry is not None
        assert sandbox.info.lease_expires_at > first_expiry
        assert sandbox.exec(["true"], timeout=5).exit_code == 0
        _wait_gone(client, sandbox.id, timeout=5)  # no renewal: it ends


def test_renewing_a_sandbox_without_lease_gives_it_one(node):
    with Client(node.address) as client:
        sandbox = client.create_sandbox()
        assert sandbox.renew_lease(0.5).lease_ttl == 0.5
        _wait_gone(client, sandbox.id, timeout=5)


def test_renew_lease_errors(node):
    with Client(node.address) as client:
        sandbox = client.create_sandbox()
        with pytest.raises(errors.InvalidArgument, match="ttl_ms"):
            sandbox.renew_lease(100 * 86400)  # past leases.max_ttl_s
        with pytest.raises(errors.InvalidArgument, match="lease_ttl_ms"):
            client.create_sandbox(lease_ttl_s=0.01)  # under the minimum of 100 ms
        sandbox.destroy()
        with pytest.raises(errors.NotFound):
            sandbox.renew_lease(5)


def test_keep_alive_renews_in_the_background(node):
    with Client(node.address) as client:
        sandbox = client.create_sandbox()
        with sandbox.keep_alive(1.0, interval_s=0.3):
            time.sleep(2.5)
            assert sandbox.exec(["true"], timeout=5).exit_code == 0
        _wait_gone(client, sandbox.id, timeout=5)


def test_lease_is_recorded_and_a_restarted_daemon_leaves_nothing(tmp_path):
    """A lease is saved in the sandbox's record; a daemon killed with -9 and restarted takes over
    no sandbox of its earlier run, so the leased sandbox is reaped at the restart (it never
    outlives its lease) and nothing of it is left."""
    require_backend("local")
    proc = DaemonProcess(tmp_path).start()
    with Client(proc.address) as client:
        sandbox = client.create_sandbox(lease_ttl_s=60)
        daemon_id = client.node_info().daemon_id
        record = json.loads((proc.state_dir / "records" / f"{sandbox.id}.json").read_text())
        expires_ms = record["lease_expires_at_unix_ms"]
        assert sandbox.info.lease_expires_at is not None
        assert expires_ms == int(sandbox.info.lease_expires_at.timestamp() * 1000)
        pids = sandbox_pids(daemon_id)  # this daemon's only sandbox
        assert pids
    proc.stop(signal.SIGKILL)
    proc.start()
    try:
        with Client(proc.address) as client:
            with pytest.raises(errors.NotFound):
                client.get_sandbox(sandbox.id)
            assert not (proc.state_dir / "records" / f"{sandbox.id}.json").exists()
            assert not alive_pids(pids)
    finally:
        proc.stop()


def test_idempotent_create_from_concurrent_retries(node):
    async def main() -> None:
        async with AsyncClient(node.address) as client:
            creates = [client.create_sandbox(idempotency_key="job-7/try", labels={"k": "v"}) for _ in range(5)]
            sandboxes = await asyncio.gather(*creates)
            assert len({s.id for s in sandboxes}) == 1
            assert len(await client.list_sandboxes(labels={"k": "v"})) == 1
            # After the first succeeded: the same id again.
            again = await client.create_sandbox(idempotency_key="job-7/try", labels={"k": "v"})
            assert again.id == sandboxes[0].id and again.info.idempotency_key == "job-7/try"
            # The same key with another request.
            with pytest.raises(errors.FailedPrecondition, match="different CreateSandbox request"):
                await client.create_sandbox(idempotency_key="job-7/try", labels={"k": "other"})
            # Once its sandbox is destroyed, the key is free again.
            await again.destroy()
            fresh = await client.create_sandbox(idempotency_key="job-7/try", labels={"k": "v"})
            assert fresh.id != again.id
            await fresh.destroy()

    asyncio.run(main())


@pytest.mark.parametrize("node", ["[admission]\nmax_starting = 1\n"], indirect=True)
def test_max_starting_refuses_with_a_retry_hint(node):
    async def main() -> None:
        async with AsyncClient(node.address) as client:
            results = await asyncio.gather(*(client.create_sandbox() for _ in range(4)), return_exceptions=True)
            made = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, BaseException)]
            assert made and refused
            for error in refused:
                assert isinstance(error, errors.ResourceExhausted), error
                assert "admission.max_starting" in str(error)
                assert error.retry_after_s is not None and error.retry_after_s > 0
            for error in refused:  # retried after the hint, one at a time: they pass
                assert isinstance(error, errors.ResourceExhausted) and error.retry_after_s is not None
                await asyncio.sleep(error.retry_after_s)
                made.append(await client.create_sandbox())
            assert len(made) == 4
            for sandbox in made:
                await sandbox.destroy()

    asyncio.run(main())


# A token every 2 s: the second create comes well within that, however slow the first one was.
@pytest.mark.parametrize("node", ["[admission]\nmax_creates_per_s = 0.5\ncreate_burst = 1\n"], indirect=True)
def test_create_rate_refuses_with_a_retry_hint(node):
    with Client(node.address) as client:
        first = client.create_sandbox()
        with pytest.raises(errors.ResourceExhausted, match="max_creates_per_s") as refused:
            client.create_sandbox()
        hint = refused.value.retry_after_s
        assert hint is not None and 0 < hint <= 2.0
        time.sleep(hint)
        second = client.create_sandbox()
        first.destroy()
        second.destroy()


def test_drain_refuses_new_work_and_lets_running_sandboxes_finish(node):
    with Client(node.address) as client:
        running = client.create_sandbox()
        state = client.drain()
        assert state.draining and not state.empty
        with pytest.raises(errors.Unavailable, match="draining"):
            client.create_sandbox()
        with pytest.raises(errors.Unavailable, match="draining"):
            client.rollouts.run(repair_task("drained"))
        with pytest.raises(errors.Unavailable, match="draining"):
            list(client.rollouts.stream([repair_task("drained-stream")]))
        assert running.exec(["echo", "still here"], timeout=5).stdout == b"still here\n"
        info = client.node_info()
        assert info.draining and not info.empty
        running.destroy()
        info = client.node_info()
        assert info.draining and info.empty
        assert not client.drain(False).draining
        client.create_sandbox().destroy()


def test_capacity_follows_the_sandboxes(node):
    with Client(node.address) as client:
        before = client.node_info().capacity
        assert before.running == before.starting == 0
        assert before.free_slots == before.max_sandboxes
        assert before.memory_available_bytes > 0 and before.cpu_available_millicores > 0
        assert before.disk_available_bytes > 0
        a = client.create_sandbox(memory_bytes=64 * MIB, cpu_millicores=500, disk_bytes=32 * MIB)
        b = client.create_sandbox(memory_bytes=96 * MIB, cpu_millicores=250, disk_bytes=64 * MIB)
        during = client.node_info().capacity
        assert during.running == 2
        assert during.free_slots == before.max_sandboxes - 2
        assert during.memory_committed_bytes == 160 * MIB
        assert during.cpu_committed_millicores == 750
        assert during.disk_committed_bytes == 96 * MIB
        a.destroy()
        b.destroy()
        after = client.node_info().capacity
        assert after.running == 0 and after.memory_committed_bytes == 0 and after.free_slots == before.max_sandboxes
