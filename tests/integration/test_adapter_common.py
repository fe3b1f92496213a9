"""Tools mode and service mode, the two ways every adapter plugs in, against a real daemon and the
built-in reference server (standing in for the trainer's inference engine)."""

from __future__ import annotations

import asyncio

import pytest

from corral.cli.run import is_token_exact
from corral.rollout.llm.sglang import SGLangClient
from corral.rollout.types import Generation, SamplingOptions
from corral.sdk import AsyncClient
from corral.trainer_adapters.common import DaemonNotRunning, ToolsModeRollouts, connect_service
from tests.rollout_tasks import repair_task, replay_server


def engine_generate(url: str):
    """The trainer's own token-in/token-out engine: here an SGLang client of the reference server."""
    engine = SGLangClient(url)

    async def generate(prompt_ids, sampling, rollout_id):
        return await engine.generate(prompt_ids, sampling)

    return engine, generate


async def test_tools_mode_runs_a_rollout_with_the_trainers_generate_function(local_daemon) -> None:
    task = repair_task("tools-mode")
    async with replay_server([task]) as server:
        engine, generate = engine_generate(server.url)
        rollouts = ToolsModeRollouts(generate, "byte", address=local_daemon.address)
        rollouts.set_policy_version(7)
        try:
            result = await rollouts.run(task)
        finally:
            await rollouts.close()
            await engine.close()
    assert result.status == "completed" and result.reward == 1.0 and is_token_exact(result)
    assert server.requests_served == 3
    async with AsyncClient(local_daemon.address) as client:
        assert not [s for s in await client.list_sandboxes() if s.labels.get("io.corral.task") == "tools-mode"]


async def test_tools_mode_cancellation_releases_the_sandbox(local_daemon) -> None:
    task = repair_task("tools-cancel")
    async with replay_server([task], latency_s=30.0) as server:
        engine, generate = engine_generate(server.url)
        rollouts = ToolsModeRollouts(generate, "byte", address=local_daemon.address)
        running = asyncio.create_task(rollouts.run(task))
        async with AsyncClient(local_daemon.address) as client:
            for _ in range(200):
                if [s for s in await client.list_sandboxes() if s.labels.get("io.corral.task") == "tools-cancel"]:
                    break
                await asyncio.sleep(0.05)
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            assert not [s for s in await client.list_sandboxes() if s.labels.get("io.corral.task") == "tools-cancel"]
        await rollouts.close()
        await engine.close()


async def test_service_mode_registers_the_trainers_servers_and_streams(local_daemon) -> None:
    task = repair_task("service-mode")
    async with replay_server([task]) as server:
        client = await connect_service([server.url], address=local_daemon.address)
        try:
            again = await connect_service([server.url], address=local_daemon.address)  # idempotent
            await again.close()
            results = [r async for r in client.rollouts.stream([task])]
        finally:
            for llm in await client.rollouts.list_llms():
                await client.rollouts.remove_llm(llm.address)
            await client.close()
    assert [r.reward for r in results] == [1.0]


async def test_a_missing_daemon_is_a_clear_error_naming_the_socket(tmp_path) -> None:
    socket = tmp_path / "nobody.sock"

    async def never_called(prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        raise AssertionError("no daemon: nothing to generate for")

    rollouts = ToolsModeRollouts(never_called, "byte", address=f"unix://{socket}")
    with pytest.raises(DaemonNotRunning, match=str(socket)):
        await rollouts.run(repair_task("x"))
    with pytest.raises(DaemonNotRunning, match="corral serve"):
        await connect_service([], address=f"unix://{socket}")
