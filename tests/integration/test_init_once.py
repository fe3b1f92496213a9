"""INIT once, fork n, in the rollout service (docs/rollouts.md, "INIT once"), on the local backend
with copy-on-write storage (local.storage = "btrfs", as test_fork.py runs it): the samples of a
submission, and tasks sharing a setup key, set up one sandbox and fork it; their results are
token-exact and rewarded as with an INIT each; a failed fork filters them and leaves nothing; a
backend that cannot fork falls back to an INIT per rollout; cancelling mid-INIT leaves nothing.

Each task's setup appends a line to setup.log and writes a random setup id; the agent copies the
setup id to seen.id, appends a line to its own shared.txt and reads the count back; the evaluation
prints seen.id and passes only when its sandbox holds exactly one line of each (the setup ran once
in its lineage, and no sibling's write shows in it). The evaluation runs in a clean sandbox: a fork of the set-up
sandbox's snapshot where the backend can fork, else a new sandbox set up again, with the agent's
shared.txt carried over."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterator

import pytest

from corral.cli.run import is_token_exact
from corral.sdk import AsyncClient, RolloutResult
from corral.sdk.rollouts import AsyncRolloutStream
from tests.conftest import DaemonProcess, require_backend
from tests.integration.test_disk_limits import own_daemon
from tests.integration.test_fork import BTRFS, pool_entries
from tests.integration.test_rollouts import result_of, wait_until
from tests.rollout_tasks import call, repair_task, replay_server

ROLLOUT_LABEL = "io.corral.rollout"
SETUP = (
    "echo ran >> setup.log && head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > setup.id",
    "sleep {sleep}",
)


def counted_task(task_id: str, *, setup_sleep_s: float = 0.0, setup_key: str = "", per_rollout: bool = False):
    """repair_task whose setup leaves a count and an id, and whose agent and evaluation read them."""
    solution = [
        call("editor", command="str_replace", path="calc.py", old_str="a - b", new_str="a + b"),
        call(
            "bash", command="cp setup.id seen.id && echo mine >> shared.txt && wc -l < shared.txt && wc -l < setup.log"
        ),
        call("submit"),
    ]
    task = repair_task(
        task_id,
        solution=solution,
        eval_command=(
            "cat seen.id && echo && test $(wc -l < setup.log) -eq 1 && test $(wc -l < shared.txt) -eq 1 "
            "&& python3 check.py"
        ),
    )
    task.setup.commands.extend(line.format(sleep=setup_sleep_s) for line in SETUP)
    task.setup_key = setup_key
    task.setup.per_rollout = per_rollout
    return task


def setup_id(result: RolloutResult) -> str:
    """The id the setup wrote in the rollout's sandbox, as the agent copied it and the evaluation
    printed it."""
    found = re.search(r"^[0-9a-f]{16}$", result.eval_output.decode(), re.MULTILINE)
    assert found is not None, result.eval_output
    return found.group()


def trajectory(result: RolloutResult) -> str:
    """What training reads of a result, comparable across rollouts."""
    return repr(
        (
            result.status,
            result.reward,
            result.finish_reason,
            result.prompt_ids,
            result.response_ids,
            result.response_mask,
            result.response_logprobs,
            result.weight_versions,
        )
    )


@pytest.fixture(scope="module")
def btrfs_daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    require_backend("local")
    with own_daemon(tmp_path_factory.mktemp("init-once"), BTRFS) as daemon:
        yield daemon


@pytest.fixture
async def client(btrfs_daemon) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(btrfs_daemon.address) as client:
        yield client
        for server in await client.rollouts.list_llms():
            await client.rollouts.remove_llm(server.address)


@contextlib.asynccontextmanager
async def replayed_stream(client: AsyncClient, tasks) -> AsyncIterator[AsyncRolloutStream]:
    """A rollout stream of the daemon's, with a replay server of `tasks` registered."""
    async with replay_server(tasks) as server:
        await client.rollouts.register_llm(server.url)
        async with client.rollouts.open_stream() as stream:
            yield stream


async def run_all(client: AsyncClient, submissions: list[tuple], tasks) -> list[RolloutResult]:
    """Submits (task, n) pairs on one stream against a replay server of `tasks`; all results."""
    async with replayed_stream(client, tasks) as stream:
        for task, n in submissions:
            await stream.submit(task, n=n)
        await stream.close_input()
        return [result_of(event) async for event in stream]


async def no_sandboxes_left(client: AsyncClient, daemon: DaemonProcess) -> None:
    """Every sandbox of the daemon's, set-up parents and children, is gone, and its storage too."""

    async def empty() -> bool:
        return await client.list_sandboxes() == [] and pool_entries(daemon) == []

    await wait_until(empty, timeout=30)


async def test_init_once_is_token_exact_and_rewarded_as_an_init_per_rollout(client, btrfs_daemon) -> None:
    shared, own = counted_task("once"), counted_task("once", per_rollout=True)
    forked = await run_all(client, [(shared, 4)], [shared])
    await no_sandboxes_left(client, btrfs_daemon)
    alone = await run_all(client, [(own, 4)], [own])
    await no_sandboxes_left(client, btrfs_daemon)
    for result in forked + alone:
        assert result.status == "completed" and result.reward == 1.0, (result.error, result.eval_output)
        assert is_token_exact(result)
    assert {trajectory(r) for r in forked} == {trajectory(r) for r in alone} and len(
        {trajectory(r) for r in alone}
    ) == 1
    # The setup ran once for the four forks, and once for each rollout without INIT once.
    assert len({setup_id(r) for r in forked}) == 1 and len({setup_id(r) for r in alone}) == 4
    for result in forked:
        assert (result.init_shared_by, result.init_fell_back) == (4, False)
        assert result.timings["fork"] > 0 and result.timings["init"] > 0
    assert all((r.init_shared_by, r.init_fell_back, r.timings["fork"]) == (0, False, 0) for r in alone)
    # Evaluated in a fork of the set-up sandbox's snapshot; a setup per rollout (whose processes
    # a fork would not have) in a new sandbox set up again.
    assert {r.eval_sandbox for r in forked} == {"snapshot_fork"} and {r.eval_sandbox for r in alone} == {"new"}
    assert all(r.timings["eval_sandbox"] > 0 and r.timings["eval_change"] > 0 for r in forked + alone)


async def test_tasks_sharing_a_setup_key_share_one_init(client, btrfs_daemon) -> None:
    """Tasks submitted apart join the INIT of their key while it sets up; a task with the same key
    but another setup does not."""
    first, second = (counted_task(f"key-{i}", setup_sleep_s=1.5, setup_key="repo@1") for i in range(2))
    other = counted_task("key-other", setup_sleep_s=1.5, setup_key="repo@1")
    other.setup.files.add(path="extra.txt", content=b"x")
    results = await run_all(client, [(first, 2), (second, 1), (other, 1)], [first, second, other])
    await no_sandboxes_left(client, btrfs_daemon)
    assert all(r.status == "completed" and r.reward == 1.0 for r in results), [r.error for r in results]
    by_task = {r.task_id: r for r in results}
    shared = [r for r in results if r.task_id != "key-other"]
    assert len({setup_id(r) for r in shared}) == 1 and [r.init_shared_by for r in shared] == [3, 3, 3]
    assert setup_id(by_task["key-other"]) != setup_id(shared[0]) and by_task["key-other"].init_shared_by == 0


async def test_a_failed_fork_filters_the_rollouts_and_leaves_nothing(tmp_path) -> None:
    """Room for 3 sandboxes' id blocks: the set-up parent takes one, and of its 4 children 2
    start and 2 cannot; the fork fails (no retries here) and its rollouts are filtered."""
    require_backend("local")
    config = BTRFS + "[sandbox]\nuid_count = 196608\n[rollout]\ninit_retries = 0\n"
    task = counted_task("fork-fails")
    with own_daemon(tmp_path, config) as daemon:
        async with AsyncClient(daemon.address) as client:
            results = await run_all(client, [(task, 4)], [task])
            assert [(r.status, r.filter_reason) for r in results] == [("filtered", "fork_failed")] * 4
            assert all("forking the set-up sandbox failed" in r.error and r.reward == 0 for r in results)
            await no_sandboxes_left(client, daemon)
            # The node is whole: a fork that fits works.
            again = await run_all(client, [(task, 2)], [task])
            assert [(r.status, r.reward, r.init_shared_by) for r in again] == [("completed", 1.0, 2)] * 2
            await no_sandboxes_left(client, daemon)


async def test_init_once_turned_off_sets_up_every_rollout_on_a_node_that_can_fork(tmp_path) -> None:
    """`[rollout] init_once = false`: on copy-on-write storage, the samples of one submission each
    set up a sandbox of their own, and none says it forked or fell back."""
    require_backend("local")
    task = counted_task("init-once-off")
    with own_daemon(tmp_path, BTRFS + "[rollout]\ninit_once = false\n") as daemon:
        async with AsyncClient(daemon.address) as client:
            results = await run_all(client, [(task, 3)], [task])
            await no_sandboxes_left(client, daemon)
    assert all(r.status == "completed" and r.reward == 1.0 for r in results), [r.error for r in results]
    assert len({setup_id(r) for r in results}) == 3
    assert {r.eval_sandbox for r in results} == {"snapshot_fork"}
    assert all((r.init_shared_by, r.init_fell_back, r.timings["fork"]) == (0, False, 0) for r in results)


async def test_a_backend_that_cannot_fork_falls_back_to_an_init_per_rollout(local_daemon) -> None:
    """The shared local daemon has no copy-on-write storage: ForkSandbox is FAILED_PRECONDITION.
    The first rollout gets the set-up sandbox, the others set up their own; all say so."""
    tasks = [counted_task("fallback-1"), counted_task("fallback-2")]
    async with AsyncClient(local_daemon.address) as client:
        try:
            results = await run_all(client, [(tasks[0], 3), (tasks[1], 2)], tasks)
        finally:
            for server in await client.rollouts.list_llms():
                await client.rollouts.remove_llm(server.address)
        assert all(r.status == "completed" and r.reward == 1.0 for r in results), [r.error for r in results]
        assert all(r.init_fell_back and r.init_shared_by == 0 and r.timings["fork"] == 0 for r in results)
        # The first rollout of each task kept the set-up sandbox, the others set up their own.
        assert len({setup_id(r) for r in results}) == 5
        # Nor can it snapshot: each evaluation starts a new sandbox and sets it up.
        assert {r.eval_sandbox for r in results} == {"new"}
        sandboxes = [
            s for s in await client.list_sandboxes() if s.labels.get("io.corral.task", "").startswith("fallback")
        ]
        assert sandboxes == []


async def setting_up(client: AsyncClient) -> bool:
    return any(ROLLOUT_LABEL in s.labels for s in await client.list_sandboxes())


async def test_cancelling_mid_init_leaves_nothing(client, btrfs_daemon) -> None:
    """Every rollout of a shared INIT cancelled while it sets up: the INIT stops (its setup would
    take a minute) and its sandbox is destroyed."""
    task = counted_task("cancelled", setup_sleep_s=60)
    async with replayed_stream(client, [task]) as stream:
        await stream.submit(task, n=3)
        await wait_until(lambda: setting_up(client))
        await stream.cancel(task_id="cancelled")
        results = [result_of(await asyncio.wait_for(stream.__anext__(), 30)) for _ in range(3)]
    assert [r.status for r in results] == ["cancelled"] * 3
    await no_sandboxes_left(client, btrfs_daemon)


async def test_a_rollout_cancelled_mid_init_gets_no_fork_and_the_others_go_on(client, btrfs_daemon) -> None:
    left, kept = (counted_task(f"part-{name}", setup_sleep_s=2, setup_key="part") for name in ("left", "kept"))
    async with replayed_stream(client, [left, kept]) as stream:
        await stream.submit(left, n=2)
        await stream.submit(kept, n=2)
        await wait_until(lambda: setting_up(client))
        await stream.cancel(task_id="part-left")
        await stream.close_input()
        results = [result_of(event) async for event in stream]
    by_status = sorted((r.task_id, r.status) for r in results)
    assert by_status == [("part-kept", "completed")] * 2 + [("part-left", "cancelled")] * 2
    completed = [r for r in results if r.status == "completed"]
    assert [(r.reward, r.init_shared_by) for r in completed] == [(1.0, 2)] * 2
    assert len({setup_id(r) for r in completed}) == 1
    await no_sandboxes_left(client, btrfs_daemon)


async def test_a_node_that_drains_mid_init_still_forks_for_rollouts_it_accepted(client, btrfs_daemon) -> None:
    """Draining refuses new sandboxes, but not those of rollouts already accepted: the set-up
    sandbox and its fork carry the shared INIT's id, a live rollout of the pipeline's."""
    task = counted_task("draining", setup_sleep_s=2)
    async with replayed_stream(client, [task]) as stream:
        await stream.submit(task, n=2)
        await wait_until(lambda: setting_up(client))
        await client.drain()
        try:
            await stream.close_input()
            results = [result_of(event) async for event in stream]
        finally:
            await client.drain(False)
    assert [(r.status, r.reward, r.init_shared_by) for r in results] == [("completed", 1.0, 2)] * 2
    await no_sandboxes_left(client, btrfs_daemon)
