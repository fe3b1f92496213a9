"""Harness tasks end to end: a real daemon (local backend), the harness of replay_harness.py talking
to the daemon's LLM gateway over HTTP, the built-in reference LLM server with the replay policy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.daemon.netns_socket import listen_in_namespace_of, shares_host_network
from corral.rollout.reference.policies import GenerateParams, PolicyOutput
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.sdk import AsyncClient, FailedPrecondition
from corral.v1 import rollout_pb2 as pb
from tests.conftest import DaemonProcess, alive_pids, require_backend
from tests.rollout_tasks import call, repair_task

HARNESS = Path(__file__).with_name("replay_harness.py")
FIX = call("bash", command="sed -i 's/a - b/a + b/' calc.py")
CHECK = call("bash", command="python3 -c 'import calc; print(calc.add(2, 2))'")


class RecordingReplay(ReplayPolicy):
    """The replay policy, remembering each prompt it saw and what it answered."""

    def __init__(self, tasks: list[pb.Task]) -> None:
        super().__init__(tasks)
        self.calls: list[tuple[list[int], list[int]]] = []

    async def generate(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput:
        output = await super().generate(input_ids, params)
        self.calls.append((list(input_ids), list(output.output_ids)))
        return output


@pytest.fixture
async def client(local_daemon) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(local_daemon.address) as client:
        yield client
        for server in await client.rollouts.list_llms():  # the daemon is shared between tests
            await client.rollouts.remove_llm(server.address)


@contextlib.asynccontextmanager
async def serving(client: AsyncClient, *tasks: pb.Task) -> AsyncIterator[RecordingReplay]:
    policy = RecordingReplay(list(tasks))
    server = ReferenceServer(policy)
    await server.start()
    try:
        await client.rollouts.register_llm(server.url)
        yield policy
    finally:
        await server.stop()


def harness_task(
    task_id: str, mode: str, *, place: pb.HarnessPlace = pb.HARNESS_PLACE_HOST, run_timeout_ms: int = 0
) -> pb.Task:
    """The repair task, solved by running the bash fix, a check, then submit, through a harness."""
    task = repair_task(task_id, solution=[FIX, CHECK, call("submit")], run_timeout_ms=run_timeout_ms)
    if place == pb.HARNESS_PLACE_SANDBOX:
        task.setup.files.add(path="/tmp/replay_harness.py", content=HARNESS.read_bytes())
        command = ["python3", "/tmp/replay_harness.py", mode]
    else:
        command = [sys.executable, str(HARNESS), mode]
    task.harness.CopyFrom(pb.TaskHarness(command=command, place=place))
    return task


def assert_token_exact(result, policy: RecordingReplay) -> None:
    """prompt + response is the last prompt the engine saw plus its output; mask 1 exactly on the
    ids the engine generated."""
    last_prompt, last_output = policy.calls[-1]
    assert result.prompt_ids + result.response_ids == last_prompt + last_output
    generated: set[int] = set()
    for prompt, output in policy.calls:
        start = len(prompt) - len(result.prompt_ids)
        assert result.prompt_ids + result.response_ids[:start] == prompt  # each call extends the last
        generated.update(range(start, start + len(output)))
    assert [i for i, mask in enumerate(result.response_mask) if mask] == sorted(generated)
    assert len(result.response_mask) == len(result.response_logprobs) == len(result.response_ids)


async def test_a_host_harness_solves_the_task_through_the_gateway(client) -> None:
    task = harness_task("host-solve", "sdk")
    async with serving(client, task) as policy:
        result = await client.rollouts.run(task)
    assert result.status == "completed", result.error
    assert result.reward == 1.0 and result.finish_reason == "submitted"
    assert len(policy.calls) == 3
    assert_token_exact(result, policy)
    assert result.extra_samples == []
    assert result.gateway is not None
    assert (result.gateway.calls, result.gateway.splits, result.gateway.splices) == (3, 0, 0)
    assert result.gateway.prefix_hits == 2  # every call after the first extended the recording exactly


async def test_a_harness_in_a_sandbox_without_network_reaches_only_the_gateway(client) -> None:
    task = harness_task("sandbox-solve", "local", place=pb.HARNESS_PLACE_SANDBOX)
    async with serving(client, task) as policy:
        # The LLM server listens on the node's loopback: the harness must not reach it (it exits 5).
        task.harness.env["PROBE_URL"] = (await client.rollouts.list_llms())[0].address + "/health"
        result = await client.rollouts.run(task)
    assert result.status == "completed", result.error
    assert result.reward == 1.0 and result.gateway is not None and result.gateway.calls == 3
    assert_token_exact(result, policy)


async def test_a_sandbox_harness_reaches_the_gateway_on_each_backend(daemon) -> None:
    # The conformance cases: each backend's sandbox (network off) gets a listener in its own
    # network namespace, or the node's where it shares the node's network.
    task = harness_task(f"sandbox-{daemon.backend}", "local", place=pb.HARNESS_PLACE_SANDBOX)
    async with AsyncClient(daemon.address) as client, serving(client, task) as policy:
        task.harness.env["PROBE_URL"] = (await client.rollouts.list_llms())[0].address + "/health"
        try:
            result = await client.rollouts.run(task)
        finally:
            for server in await client.rollouts.list_llms():
                await client.rollouts.remove_llm(server.address)
    assert result.status == "completed", result.error
    assert result.reward == 1.0
    assert_token_exact(result, policy)


async def test_a_harness_that_exits_non_zero_is_filtered_with_its_output(client) -> None:
    task = harness_task("exit3", "exit3")
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert (result.status, result.filter_reason) == ("filtered", "harness_failed")
    assert "exited 3" in result.error and "the harness gives up" in result.error


async def test_a_harness_that_cannot_start_is_filtered(client) -> None:
    task = harness_task("no-harness", "sdk")
    task.harness.command[:] = ["/nonexistent/harness"]
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert (result.status, result.filter_reason) == ("filtered", "harness_failed")
    assert "could not be started" in result.error


async def test_a_harness_past_the_run_timeout_is_killed_and_evaluated(client, tmp_path) -> None:
    task = harness_task("hang", "hang", run_timeout_ms=1500)
    task.harness.env["PID_FILE"] = str(tmp_path / "pid")
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.finish_reason == "timeout"
    assert result.reward == 0.0  # evaluated: calc.py was never fixed
    assert not alive_pids({int((tmp_path / "pid").read_text())})


async def test_a_sandbox_harness_past_the_run_timeout_is_evaluated(client) -> None:
    task = harness_task("sandbox-hang", "hang", place=pb.HARNESS_PLACE_SANDBOX, run_timeout_ms=1500)
    task.harness.env["PID_FILE"] = "/tmp/harness.pid"
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.finish_reason == "timeout" and result.reward == 0.0


async def test_the_call_limit_ends_a_harness_rollout_as_max_turns(client) -> None:
    # Two calls allowed: the fix and the check; the third (submit) is refused and the harness
    # exits 1, which the limit explains.
    task = harness_task("two-calls", "sdk")
    task.limits.max_turns = 2
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.finish_reason == "max_turns", result.error
    assert result.reward == 1.0 and result.gateway is not None and result.gateway.calls == 2


async def test_a_prompt_that_leaves_no_room_ends_a_harness_rollout_as_context_full(client) -> None:
    task = harness_task("tight", "sdk")
    task.limits.max_total_tokens = 64  # less than the first prompt
    async with serving(client, task) as policy:
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.finish_reason == "context_full", result.error
    assert policy.calls == [] and result.response_ids == []


async def test_a_harness_whose_sandbox_failed_is_filtered_as_a_backend_crash(client) -> None:
    task = harness_task("crash", "crash")
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert (result.status, result.filter_reason) == ("filtered", "backend_crash"), result.error


async def harness_pid(pid_file: Path) -> int:
    """The pid the "hang" harness wrote once it started (it writes it first thing)."""
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.05)
    return int(pid_file.read_text())


async def test_cancelling_a_harness_rollout_kills_the_harness(client, tmp_path) -> None:
    task = harness_task("cancel-hang", "hang")
    pid_file = tmp_path / "pid"
    task.harness.env["PID_FILE"] = str(pid_file)
    async with serving(client, task):
        async with client.rollouts.open_stream() as stream:
            await stream.submit(task)
            pid = await harness_pid(pid_file)
            assert alive_pids({pid})
            await stream.cancel(task_id="cancel-hang")
            result = await asyncio.wait_for(stream.__anext__(), 10)
    assert result.status == "cancelled"
    assert not alive_pids({pid})


async def test_the_llm_server_down_filters_the_rollout_whatever_the_harness_does(client) -> None:
    task = harness_task("llm-down", "sdk")
    async with serving(client, task):
        pass  # registered, then stopped: every generation fails
    result = await client.rollouts.run(task)
    assert (result.status, result.filter_reason) == ("filtered", "llm_unreachable"), result.error


async def test_a_rewritten_history_under_policy_fail_is_filtered(client) -> None:
    task = harness_task("rewrite-fail", "rewrite")
    task.harness.history_policy = pb.HISTORY_POLICY_FAIL
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert (result.status, result.filter_reason) == ("filtered", "history_rewritten"), result.error


async def test_a_rewritten_history_under_policy_split_gives_two_samples(client) -> None:
    task = harness_task("rewrite-split", "rewrite")
    async with serving(client, task) as policy:
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.reward == 1.0, result.error
    assert result.gateway is not None and result.gateway.splits == 1
    assert len(result.extra_samples) == 1
    # The first sample is the first call alone; the second, the rewritten conversation to the end.
    first_prompt, first_output = policy.calls[0]
    assert result.prompt_ids + result.response_ids == first_prompt + first_output
    second = result.extra_samples[0]
    assert second.prompt_ids + second.response_ids == policy.calls[-1][0] + policy.calls[-1][1]
    assert sum(second.response_mask) == sum(len(output) for _, output in policy.calls[1:])


async def test_a_rewritten_history_under_policy_mask_leaves_nothing_to_train_on(client) -> None:
    task = harness_task("rewrite-mask", "rewrite")
    task.harness.history_policy = pb.HISTORY_POLICY_MASK
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.reward == 1.0, result.error
    assert len(result.extra_samples) == 1
    assert result.gateway is not None and (result.gateway.splits, result.gateway.masked_samples) == (1, 2)
    assert not any(result.response_mask) and not any(result.extra_samples[0].response_mask)


async def test_a_harness_that_makes_no_call_is_evaluated_with_an_empty_trajectory(client) -> None:
    task = harness_task("no-calls", "sdk")
    task.harness.command[:] = [sys.executable, "-c", "pass"]
    async with serving(client, task):
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.finish_reason == "submitted"
    assert result.reward == 0.0 and result.response_ids == [] and result.prompt_ids == []
    assert result.gateway is not None and result.gateway.calls == 0


async def test_host_harnesses_need_the_daemons_consent_and_counters_reach_the_metrics(tmp_path) -> None:
    require_backend("local")
    port = free_port()
    daemon = DaemonProcess(tmp_path, "--metrics", f"127.0.0.1:{port}").start()  # allow_host_harness = false
    try:
        async with AsyncClient(daemon.address) as client:
            with pytest.raises(FailedPrecondition, match="allow_host_harness"):
                await client.rollouts.run(harness_task("refused", "sdk"))
            task = harness_task("in-sandbox", "local", place=pb.HARNESS_PLACE_SANDBOX)
            task.harness.env["PROBE_URL"] = "http://127.0.0.1:1/"
            async with serving(client, task):
                result = await client.rollouts.run(task)
        assert result.status == "completed" and result.reward == 1.0, result.error
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "corral_gateway_calls_total 3.0" in metrics
        assert "corral_gateway_prefix_hits_total 2.0" in metrics
        assert "corral_gateway_splits_total 0.0" in metrics
    finally:
        daemon.stop()


async def test_stopping_the_daemon_kills_a_running_harness(tmp_path) -> None:
    require_backend("local")
    config = tmp_path / "corral.toml"
    config.write_text("[rollout]\nallow_host_harness = true\n")
    daemon = DaemonProcess(tmp_path, "--config", str(config)).start()
    pid_file = tmp_path / "pid"
    task = harness_task("shutdown-hang", "hang")
    task.harness.env["PID_FILE"] = str(pid_file)
    try:
        async with AsyncClient(daemon.address) as client, serving(client, task):
            async with client.rollouts.open_stream() as stream:
                await stream.submit(task)
                pid = await harness_pid(pid_file)
                assert alive_pids({pid})
                assert daemon.proc is not None
                daemon.proc.send_signal(signal.SIGTERM)  # rollouts end first, while it still serves
                for _ in range(200):
                    if not alive_pids({pid}):
                        break
                    await asyncio.sleep(0.05)
                assert not alive_pids({pid})
    finally:
        assert daemon.stop() == 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_a_socket_made_in_another_network_namespace_serves_only_there() -> None:
    if os.geteuid() != 0:
        pytest.skip("entering a network namespace needs root")
    holder = await asyncio.create_subprocess_exec("unshare", "--net", "sleep", "60")  # a bare netns, lo down
    try:
        for _ in range(250):  # until unshare has made the namespace
            if not shares_host_network(holder.pid):
                break
            await asyncio.sleep(0.02)
        assert not shares_host_network(holder.pid) and shares_host_network(os.getpid())
        listener = await listen_in_namespace_of(holder.pid)
        port = listener.getsockname()[1]
        loop = asyncio.get_running_loop()

        async def answer() -> None:
            connection, _ = await loop.sock_accept(listener)
            with connection:
                await loop.sock_sendall(connection, b"from the daemon")

        answering = asyncio.ensure_future(answer())
        inside = await asyncio.create_subprocess_exec(
            "nsenter", "-t", str(holder.pid), "-n", sys.executable, "-c",
            f"import socket; print(socket.create_connection(('127.0.0.1', {port})).recv(100).decode())",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert (await inside.communicate())[0] == b"from the daemon\n"
        await answering
        with pytest.raises(OSError):  # the node's own loopback has no such listener
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        listener.close()
    finally:
        holder.kill()
        await holder.wait()
