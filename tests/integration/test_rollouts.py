"""The RolloutService end to end: a real daemon (local backend), real sandboxes, the built-in
reference LLM server over real HTTP."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from corral.cli.run import is_token_exact
from corral.sdk import AlreadyExists, AsyncClient, FailedPrecondition, InvalidArgument, NotFound, RolloutResult
from corral.sdk.rollouts import RolloutEvent
from corral.v1 import rollout_pb2 as pb
from tests.conftest import DaemonProcess, require_backend
from tests.rollout_tasks import call, repair_task, replay_server

ROLLOUT_LABEL = "io.corral.rollout"


@pytest.fixture
async def client(local_daemon):
    async with AsyncClient(local_daemon.address) as client:
        yield client
        for server in await client.rollouts.list_llms():  # the daemon is shared between tests
            await client.rollouts.remove_llm(server.address)


async def rollout_sandboxes(client: AsyncClient) -> list:
    return [s for s in await client.list_sandboxes() if ROLLOUT_LABEL in s.labels]


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_run_replays_a_task_to_reward_one_with_a_token_exact_trajectory(client) -> None:
    task = repair_task("run-one")
    async with replay_server([task]) as server:
        await client.rollouts.register_llm(server.url)
        result = await client.rollouts.run(task)
    assert result.status == "completed", result.error
    assert result.reward == 1.0
    assert result.finish_reason == "submitted"
    assert [turn.tool_calls[0].name for turn in result.turns] == ["editor", "bash", "submit"]
    assert is_token_exact(result)
    # Generated tokens carry mask 1, their logprob and a weight version; the rest mask 0 and -1.
    for mask, logprob, version in zip(result.response_mask, result.response_logprobs, result.weight_versions):
        assert (mask == 1 and version == 0) or (mask == 0 and version == -1 and logprob == 0.0)
    assert sum(result.response_mask) == sum(len(t.generated_ids) for t in result.turns)
    assert result.messages[0]["role"] == "system" and "# Tools" in result.messages[0]["content"]
    assert result.messages[1]["content"] == "[run-one] add() in calc.py is wrong; fix it."
    assert result.turns[1].tool_time_ms >= 0 and result.timings["total"] > 0
    assert b"ok" in result.eval_output
    assert await rollout_sandboxes(client) == []


async def test_stream_returns_each_sample_as_it_finishes_with_a_shared_group(client) -> None:
    tasks = [repair_task(f"stream-{i}") for i in range(3)]
    async with replay_server(tasks) as server:
        await client.rollouts.register_llm(server.url)
        results = [r async for r in client.rollouts.stream(tasks, n=2)]
    assert len(results) == 6
    assert all(r.status == "completed" and r.reward == 1.0 for r in results)
    groups: dict[str, set] = {}
    for r in results:
        groups.setdefault(r.task_id, set()).add(r.group_id)
    assert all(len(ids) == 1 for ids in groups.values()) and len({g for ids in groups.values() for g in ids}) == 3
    assert sorted(r.sample_index for r in results if r.task_id == "stream-0") == [0, 1]
    assert len({r.rollout_id for r in results}) == 6
    assert await rollout_sandboxes(client) == []


async def test_streamed_turns_arrive_before_their_result(client) -> None:
    task = repair_task("turns")
    async with replay_server([task]) as server:
        await client.rollouts.register_llm(server.url)
        events = [e async for e in client.rollouts.stream([task], turns=True)]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["RolloutTurn", "RolloutTurn", "RolloutTurn", "RolloutResult"]
    assert [t.generated_ids for t in events[:3]] == [t.generated_ids for t in events[3].turns]
    assert {t.rollout_id for t in events[:3]} == {events[3].rollout_id}


async def test_rewards_from_a_printed_number_and_a_junit_report(client) -> None:
    printed = repair_task(
        "printed", eval_command="python3 check.py >/dev/null && echo 'score: 0.75'", reward="printed_number"
    )
    report = (
        '<testsuite><testcase classname="tests.test_calc" name="test_add"/>'
        '<testcase classname="tests.test_calc.TestMore" name="test_big"><failure/></testcase>'
        '<testcase classname="tests.test_calc" name="test_neg"/></testsuite>'
    )
    junit = repair_task("junit", eval_command=f"echo '{report}' > report.xml")
    junit.evaluation.ClearField("exit_status")
    junit.evaluation.junit.report_path = "report.xml"
    junit.evaluation.junit.tests.extend(
        [
            "tests/test_calc.py::test_add",
            "tests/test_calc.py::TestMore::test_big",
            "tests/test_calc.py::test_missing",
            "tests/test_calc.py::test_neg",
        ]
    )
    async with replay_server([printed, junit]) as server:
        await client.rollouts.register_llm(server.url)
        results = {r.task_id: r async for r in client.rollouts.stream([printed, junit])}
    assert results["printed"].reward == 0.75
    assert results["junit"].reward == 0.5  # 2 of 4 named tests passed; the missing one counts as failed


async def test_a_failing_test_is_reward_zero_not_a_filter(client) -> None:
    task = repair_task("unsolved", solution=[call("submit")])
    async with replay_server([task]) as server:
        await client.rollouts.register_llm(server.url)
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.reward == 0.0
    assert b"AssertionError" in result.eval_output


async def test_each_infrastructure_failure_is_filtered_with_its_reason(client) -> None:
    bad_image = repair_task("bad-image")
    bad_image.image = "/nonexistent/rootfs"
    setup_fails = repair_task("setup-fails")
    setup_fails.setup.commands.append("exit 3")
    tasks = [bad_image, setup_fails]
    async with replay_server(tasks) as server:
        await client.rollouts.register_llm(server.url)
        results = {r.task_id: r async for r in client.rollouts.stream(tasks)}
    assert {task_id: (r.status, r.filter_reason) for task_id, r in results.items()} == {
        "bad-image": ("filtered", "sandbox_start"),
        "setup-fails": ("filtered", "sandbox_start"),
    }
    assert "exited 3" in results["setup-fails"].error
    assert all(r.reward == 0.0 for r in results.values())
    assert await rollout_sandboxes(client) == []


async def test_an_evaluation_that_crashes_or_judges_nothing_after_the_agent_ran_is_reward_zero(client) -> None:
    # The agent's code runs in the evaluation: a crash, a failing preparatory command or a missing
    # verdict is its doing, and a filter would let it dodge the 0.
    crashes = repair_task("eval-crashes", eval_command="python3 -c 'import os; os.abort()'")
    no_number = repair_task("no-number", eval_command="true", reward="printed_number")
    no_report = repair_task("no-report", eval_command="true")
    no_report.evaluation.junit.report_path = "report.xml"
    step_fails = repair_task("step-fails")
    step_fails.evaluation.commands.insert(0, "false")
    tasks = [crashes, no_number, no_report, step_fails]
    async with replay_server(tasks) as server:
        await client.rollouts.register_llm(server.url)
        results = {r.task_id: r async for r in client.rollouts.stream(tasks)}
    assert {task_id: (r.status, r.reward) for task_id, r in results.items()} == {
        task.task_id: ("completed", 0.0) for task in tasks
    }
    assert b"signal" in results["eval-crashes"].eval_output
    assert b"printed no number" in results["no-number"].eval_output
    assert b"no JUnit report" in results["no-report"].eval_output
    assert b"'false' exited 1" in results["step-fails"].eval_output
    assert len(results["eval-crashes"].turns) == 3  # the trajectory is kept


async def test_an_llm_server_that_is_down_filters_as_llm_unreachable(client) -> None:
    await client.rollouts.register_llm("http://127.0.0.1:9")  # nothing listens on the discard port
    result = await client.rollouts.run(repair_task("llm-down"))
    assert (result.status, result.filter_reason) == ("filtered", "llm_unreachable")
    assert result.turns == []
    assert await rollout_sandboxes(client) == []


async def test_staleness_filters_rollouts_generated_too_many_versions_ago(client) -> None:
    task = repair_task("stale")
    async with replay_server([task]) as server:  # the replay policy generates as version 0
        await client.rollouts.register_llm(server.url)
        current = (await client.rollouts.stats()).policy_version
        await client.rollouts.set_policy_version(current + 3)
        stale = await client.rollouts.run(task, max_staleness=2)
        fresh_enough = await client.rollouts.run(task, max_staleness=current + 3)
        with pytest.raises(FailedPrecondition):
            await client.rollouts.set_policy_version(current + 2)  # versions only move forward
    assert (stale.status, stale.filter_reason) == ("filtered", "staleness")
    assert "versions behind" in stale.error
    assert fresh_enough.status == "completed"


async def test_cancelling_frees_the_sandbox_at_once(client) -> None:
    task = repair_task("slow")
    async with replay_server([task], latency_s=30.0) as server:  # the first generation never comes in time
        await client.rollouts.register_llm(server.url)
        async with client.rollouts.open_stream() as stream:
            await stream.submit(task)
            await wait_until(lambda: _has_sandbox_for(client, "slow"))
            await stream.cancel(task_id="slow")
            result = await asyncio.wait_for(stream.__anext__(), 10)
    assert result.status == "cancelled"
    assert await rollout_sandboxes(client) == []


def result_of(event: RolloutEvent) -> RolloutResult:
    """The event of a stream whose submissions did not ask for turns: a result."""
    assert isinstance(event, RolloutResult), event
    return event


async def _has_sandbox_for(client: AsyncClient, task_id: str) -> bool:
    return any(s.labels.get("io.corral.task") == task_id for s in await rollout_sandboxes(client))


async def test_closing_a_stream_cancels_its_rollouts(client) -> None:
    task = repair_task("abandoned")
    async with replay_server([task], latency_s=30.0) as server:
        await client.rollouts.register_llm(server.url)
        stream = client.rollouts.open_stream()
        await stream.submit(task)
        await wait_until(lambda: _has_sandbox_for(client, "abandoned"))
        await stream.close()
        await wait_until(lambda: _no_rollout_sandboxes(client))


async def _no_rollout_sandboxes(client: AsyncClient) -> bool:
    return await rollout_sandboxes(client) == []


async def test_run_timeout_keeps_the_trajectory_and_still_evaluates(client) -> None:
    task = repair_task("run-timeout", run_timeout_ms=1200)
    async with replay_server([task], latency_s=0.5) as server:  # three turns need 1.5 s
        await client.rollouts.register_llm(server.url)
        result = await client.rollouts.run(task)
    assert result.status == "completed" and result.finish_reason == "timeout"
    assert 1 <= len(result.turns) < 3 and is_token_exact(result)
    assert 1.1 < result.timings["run"] < 3


async def test_bad_requests_get_clear_errors(client) -> None:
    with pytest.raises(FailedPrecondition, match="RegisterLLM"):
        await client.rollouts.run(repair_task("no-llm"))
    await client.rollouts.register_llm("http://127.0.0.1:9")
    with pytest.raises(AlreadyExists):
        await client.rollouts.register_llm("http://127.0.0.1:9/")
    with pytest.raises(InvalidArgument):
        await client.rollouts.register_llm("ftp://example")
    with pytest.raises(NotFound):
        await client.rollouts.remove_llm("http://127.0.0.1:10")
    with pytest.raises(InvalidArgument, match="task_id"):
        await client.rollouts.run({"prompt": {"messages": [{"role": "user", "content": "hi"}]}})
    with pytest.raises(InvalidArgument, match="have no .file."):
        bad = repair_task("missing-field")
        bad.prompt.fields.clear()
        await client.rollouts.run(bad)
    with pytest.raises(InvalidArgument, match="rejected"):
        async for _ in client.rollouts.stream([pb.Task(task_id="empty")]):
            pass


async def test_stats_count_results_and_list_servers(client) -> None:
    task = repair_task("stats")
    before = await client.rollouts.stats()
    async with replay_server([task]) as server:
        await client.rollouts.register_llm(server.url, weight=2)
        await client.rollouts.run(task)
        stats = await client.rollouts.stats()
    assert stats.results_completed == before.results_completed + 1
    assert stats.eval.completed == before.eval.completed + 1
    assert stats.run.workers >= 1 and stats.init.queued == 0
    [llm] = stats.llm_servers
    assert llm.address == server.url and llm.weight == 2 and llm.requests == 3 and llm.healthy


async def test_64_rollouts_over_two_servers_one_dying_midway_are_all_accounted_for(client) -> None:
    tasks = [repair_task(f"many-{i}") for i in range(64)]
    async with replay_server(tasks, latency_s=0.05) as steady, replay_server(tasks, latency_s=0.05) as dying:
        await client.rollouts.register_llm(steady.url)
        await client.rollouts.register_llm(dying.url)
        # The server dies after a sixth of the requests, counted where they are served: counting
        # results instead let every rollout finish its turns first on a loaded node (EVAL is the
        # slow stage), and the death then cost nothing to tell.
        served_before_death = len(tasks) * 3 // 6

        async def die_midway() -> None:
            while dying.requests_served < served_before_death:
                await asyncio.sleep(0.005)
            await dying.stop()

        killer = asyncio.create_task(die_midway())
        try:
            results = [result async for result in client.rollouts.stream(tasks)]
        finally:
            killer.cancel()
        assert killer.done() and not killer.cancelled(), f"the dying server served {dying.requests_served}"
    assert sorted(r.task_id for r in results) == sorted(t.task_id for t in tasks)
    # The pool retries on the steady server: a dead server costs no rollout.
    assert [r for r in results if r.status != "completed"] == []
    assert all(r.reward == 1.0 and is_token_exact(r) for r in results)
    assert steady.requests_served > 0 and dying.requests_served > 0
    [dead] = [s for s in await client.rollouts.list_llms() if s.address == dying.url]
    assert not dead.healthy and dead.failures >= 1
    assert await rollout_sandboxes(client) == []


async def test_daemon_shutdown_mid_rollout_filters_as_shutdown(tmp_path) -> None:
    require_backend("local")
    daemon = DaemonProcess(tmp_path).start()
    proc = daemon.proc
    assert proc is not None  # started
    task = repair_task("shutdown")
    try:
        async with AsyncClient(daemon.address) as client, replay_server([task], latency_s=30.0) as server:
            await client.rollouts.register_llm(server.url)
            async with client.rollouts.open_stream() as stream:
                await stream.submit(task)
                await wait_until(lambda: _has_sandbox_for(client, "shutdown"))
                proc.send_signal(signal.SIGTERM)
                result = result_of(await asyncio.wait_for(stream.__anext__(), 20))
        assert (result.status, result.filter_reason) == ("filtered", "shutdown")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            daemon.stop()
    # The daemon's state directory shows no sandbox left behind.
    assert not any((daemon.state_dir / "sandboxes").glob("*")) if (daemon.state_dir / "sandboxes").exists() else True


def test_results_serialise_to_json(tmp_path) -> None:
    from corral.cli.run import result_to_dict
    from corral.sdk.rollout_messages import result_from_proto

    result = result_from_proto(
        pb.RolloutResult(
            rollout_id="r", task_id="t", eval_output=b"\xff ok", status=pb.ROLLOUT_STATUS_COMPLETED, response_ids=[1, 2]
        )
    )
    data = json.loads(json.dumps(result_to_dict(result)))
    assert data["status"] == "completed" and data["response_ids"] == [1, 2] and data["eval_output"] == "\ufffd ok"


async def test_stage_timeouts_exclude_time_spent_queued(tmp_path) -> None:
    require_backend("local")
    config = tmp_path / "corral.toml"
    config.write_text("[rollout]\nrun_workers = 1\n")
    daemon = DaemonProcess(tmp_path, "--config", str(config)).start()
    # Each RUN is three turns of 1 s of the server's latency plus its tools' time: 3 s and a bit,
    # under its 5 s timeout with 2 s left for the tools however loaded the machine is; with one RUN
    # worker the third rollout waits for the two RUNs before it, at least 6 s, past the timeout.
    # (With a margin proportional to the latency, the verdict cannot depend on the load.)
    tasks = [repair_task(f"queued-{i}", run_timeout_ms=5000) for i in range(3)]
    try:
        async with AsyncClient(daemon.address) as client, replay_server(tasks, latency_s=1.0) as server:
            await client.rollouts.register_llm(server.url)
            results = [r async for r in client.rollouts.stream(tasks)]
    finally:
        daemon.stop()
    assert [r.finish_reason for r in results] == ["submitted"] * 3, [r.timings for r in results]
    assert all(r.reward == 1.0 for r in results)
    assert max(r.timings["run_queue"] for r in results) > 5.0
    assert all(r.timings["run"] < 5.0 for r in results)


def _refused_once(daemon: DaemonProcess, task_id: str) -> bool:
    """Whether the daemon's log shows a sandbox start of a rollout of `task_id` refused once."""
    log = daemon.log.read_text(errors="replace")
    return any(f" {task_id}/" in line and "sandbox start failed (attempt 1 of" in line for line in log.splitlines())


async def test_sandbox_starts_that_fail_for_the_node_are_retried_then_filtered(tmp_path) -> None:
    """A node at its sandbox limit with sandboxes that are not the rollouts' refuses creation
    (RESOURCE_EXHAUSTED): INIT retries with a backoff, and gives up with reason sandbox_start when
    the retries run out. (For the rollouts' own sandboxes INIT waits instead: docs/rollouts.md,
    "The pipeline".)"""
    require_backend("local")
    config = tmp_path / "corral.toml"
    config.write_text("[daemon]\nmax_sandboxes = 1\n[rollout]\ninit_retries = 4\n")
    daemon = DaemonProcess(tmp_path, "--config", str(config)).start()
    waiter = repair_task("waiter")

    async def refused_once() -> bool:
        return _refused_once(daemon, "waiter")

    try:
        async with AsyncClient(daemon.address) as client, replay_server([waiter]) as server:
            await client.rollouts.register_llm(server.url)
            # A sandbox made on the node directly holds the only slot until the waiter was refused
            # once; its retries (after 0.5, 1, 2 and 4 s) get the slot once the holder is gone.
            holder = await client.create_sandbox()
            async with client.rollouts.open_stream() as stream:
                await stream.submit(waiter)
                await stream.close_input()
                await wait_until(refused_once, timeout=60)
                await holder.destroy()
                results = [result_of(e) async for e in stream]
            assert [(r.status, r.reward) for r in results] == [("completed", 1.0)], results[0].error
            assert results[0].timings["init"] > 0.4  # it waited at least one backoff
            # A holder that never lets go: the waiter's retries run out.
            async with await client.create_sandbox(), client.rollouts.open_stream() as stream:
                await stream.submit(waiter)
                result = result_of(await asyncio.wait_for(stream.__anext__(), 30))
                assert (result.task_id, result.status, result.filter_reason) == ("waiter", "filtered", "sandbox_start")
                assert "5 times" in result.error
    finally:
        daemon.stop()
