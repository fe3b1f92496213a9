"""corral.cluster on a real multi-node Ray cluster on this machine: three raylets
(ray.cluster_utils.Cluster), each a Ray node of one CPU with a small object store, each with its
CorralNode actor and its own corral daemon (own socket, state directory and configuration).

The nodes' sandbox caps differ (NODE_CAPS), so placement by capacity shows; the module's last
test kills a node (its daemon and its raylet) in the middle of a stream of rollouts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import alive_pids, require_backend, require_cluster, sandbox_pids

require_cluster("ray", "ray", "ray")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from corral.cluster import ClusterClient, DaemonSupervisor, start_node  # noqa: E402
from corral.sdk import AsyncClient, errors  # noqa: E402
from tests.rollout_tasks import call, repair_task, replay_server  # noqa: E402

MIB = 1 << 20
# Sandboxes each node's daemon admits (daemon.max_sandboxes): head, second, third.
NODE_CAPS = (6, 6, 8)
# Tasks, and samples of each, of the test that reruns a crashed daemon's rollouts.
RERUN_TASKS = 20
RERUN_SAMPLES = 2
# A node's rollouts never hold more sandboxes than its cap, those waiting for RUN or EVAL and those
# still being torn down included: an INIT waits for room among them (docs/rollouts.md, "The
# pipeline"), however slowly the loaded machine tears sandboxes down. A cap must hold what one INIT
# needs at once: a shared INIT's set-up sandbox and a child per sample.
assert min(NODE_CAPS) >= RERUN_SAMPLES + 1
NODE_CONFIG = (
    "[daemon]\nmemory_overcommit = 0.0\nmax_sandboxes = {cap}\n"
    "[rollout]\ninit_workers = 1\nrun_workers = 2\neval_workers = 1\nllm_unavailable_wait_s = 2\n"
)
# The rollouts of the node-loss test (the scale the cluster client is specified against).
ROLLOUTS = int(os.environ.get("CORRAL_TEST_CLUSTER_ROLLOUTS", "200"))
# How long a killed daemon may take to be started again by its CorralNode and be back in the
# client's placement (a bound on the wait, not a pause: the wait ends as soon as it is back).
RESTART_DEADLINE_S = 60


@dataclass
class RayNodes:
    cluster: Cluster
    raylets: list[Any]  # ray._private.node.Node, head first
    actors: list[Any]  # their CorralNode actors
    roots: list[Path]  # their daemons' directories

    @property
    def node_ids(self) -> list[str]:
        return [raylet.node_id for raylet in self.raylets]


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory) -> Iterator[RayNodes]:
    require_backend("local")
    small: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 75 * MIB}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        for _ in NODE_CAPS[1:]:
            cluster.add_node(**small)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        raylets = cluster.list_all_nodes()
        roots = [tmp_path_factory.mktemp(f"corral-node{i}") for i in range(len(raylets))]
        actors = [
            start_node(raylet.node_id, root=str(root), config_text=NODE_CONFIG.format(cap=cap))
            for raylet, root, cap in zip(raylets, roots, NODE_CAPS)
        ]
        ray.get([actor.report.remote() for actor in actors])
        yield RayNodes(cluster, raylets, actors, roots)
        for actor in actors:
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # its node was killed
    finally:
        ray.shutdown()
        cluster.shutdown()


def _log_sizes(nodes: RayNodes) -> list[int]:
    """How much each node's daemon has logged so far (its supervisor's root/daemon.log)."""
    return [(root / "daemon.log").stat().st_size for root in nodes.roots]


def _refused_for_room_since(nodes: RayNodes, sizes: list[int]) -> list[str]:
    """What the nodes' rollout pipelines logged since `sizes` about a sandbox start or fork the
    node refused at daemon.max_sandboxes (then retried, or filtered once the retries ran out)."""
    refused = []
    for root, size in zip(nodes.roots, sizes):
        with open(root / "daemon.log", "rb") as log:
            log.seek(size)
            lines = log.read().decode(errors="replace").splitlines()
        refused += [f"{root.name}: {line}" for line in lines if "corral.rollout" in line and "max_sandboxes" in line]
    return refused


async def _sandboxes_by_node(nodes: RayNodes, cluster: ClusterClient, label: str) -> dict[str, int]:
    counts = {}
    for node_id in nodes.node_ids:
        node = cluster.nodes[node_id]
        if not node.lost:
            counts[node_id] = len(await node.client.list_sandboxes({"test": label}))
    return counts


async def test_each_actor_runs_on_its_own_node_with_its_own_daemon(ray_nodes: RayNodes) -> None:
    reports = await asyncio.gather(*(actor.report.remote() for actor in ray_nodes.actors))
    assert [r.node_id for r in reports] == ray_nodes.node_ids
    assert len({r.address for r in reports}) == len(reports)
    assert len({r.info.daemon_id for r in reports}) == len(reports)
    assert [r.info.capacity.max_sandboxes for r in reports] == list(NODE_CAPS)
    assert all(r.daemon_pid and r.restarts == 0 for r in reports)
    # A client finds them by name, one per node.
    found = ClusterClient.from_ray()
    async with found:
        assert sorted(found.nodes) == sorted(ray_nodes.node_ids)


async def test_an_actor_attaches_to_a_daemon_already_on_its_node(ray_nodes: RayNodes) -> None:
    running = await ray_nodes.actors[0].report.remote()
    attached = start_node(ray_nodes.node_ids[0], attach_address=running.address, name="corral-node-attach-test")
    try:
        report = await attached.report.remote()
        assert report.info.daemon_id == running.info.daemon_id
        assert report.daemon_pid is None and report.address == running.address
    finally:
        await attached.stop.remote()
        ray.kill(attached)
    # Stopping an attached actor leaves the daemon it did not start alone.
    assert (await ray_nodes.actors[0].report.remote()).info is not None


async def test_placement_fills_nodes_by_capacity_and_a_node_at_its_cap_gets_nothing(ray_nodes: RayNodes) -> None:
    # Polled once an hour: placement runs on this client's own count and what it asks for.
    async with ClusterClient(ray_nodes.actors, lease_ttl_s=60, poll_interval_s=3600) as cluster:
        first = await cluster.create_sandbox(labels={"test": "caps"})
        # The node with the most room takes the first sandbox.
        assert cluster.node_of(first.id) is cluster.nodes[ray_nodes.node_ids[2]]
        sandboxes = [first]
        for _ in range(sum(NODE_CAPS) - 1):
            sandboxes.append(await cluster.create_sandbox(labels={"test": "caps"}))
        counts = await _sandboxes_by_node(ray_nodes, cluster, "caps")
        assert counts == dict(zip(ray_nodes.node_ids, NODE_CAPS))
        with pytest.raises(errors.ResourceExhausted, match="no corral node has room"):
            await cluster.create_sandbox(labels={"test": "caps"})
        assert await _sandboxes_by_node(ray_nodes, cluster, "caps") == counts
        # One freed slot on the second node, before any poll has seen it: the next sandbox goes
        # there and nowhere else.
        second_node = cluster.nodes[ray_nodes.node_ids[1]]
        freed = next(sb for sb in sandboxes if cluster.node_of(sb.id) is second_node)
        await freed.destroy()
        sandboxes.remove(freed)
        refill = await cluster.create_sandbox(labels={"test": "caps"})
        assert cluster.node_of(refill.id) is second_node
        sandboxes.append(refill)
        await asyncio.gather(*(sb.destroy() for sb in sandboxes))


async def test_commands_go_to_the_chosen_daemon_directly(ray_nodes: RayNodes) -> None:
    async with ClusterClient(ray_nodes.actors) as cluster, cluster.create_sandbox() as sandbox:
        node = cluster.node_of(sandbox.id)
        assert node is not None
        # The handle is the node's own SDK sandbox: it speaks to that daemon's socket.
        assert sandbox._transport.address.location == node.address.removeprefix("unix://")
        assert (await sandbox.exec(["echo", "hi"], timeout=10)).stdout == b"hi\n"
        assert (await cluster.get_sandbox(sandbox.id)).id == sandbox.id


async def test_a_node_listening_on_tcp_is_reached_there_with_its_token(ray_nodes: RayNodes, tmp_path) -> None:
    # A second CorralNode on the head node, as on a machine the client is not on: TCP and a token.
    actor = start_node(
        ray_nodes.node_ids[0],
        root=str(tmp_path),
        config_text=NODE_CONFIG.format(cap=2),
        tcp_host="127.0.0.1",
        name="corral-node-tcp-test",
    )
    try:
        report = await actor.report.remote()
        assert report.address.startswith("127.0.0.1:") and report.token
        task = _quick_task("over-tcp")
        async with replay_server([task]) as server, ClusterClient([actor]) as cluster:
            async with cluster.create_sandbox() as sandbox:
                assert sandbox._transport.address.transport == "tcp"
                assert (await sandbox.exec(["true"], timeout=10)).exit_code == 0
            await cluster.rollouts.register_llm(server.url)
            [result] = [r async for r in cluster.rollouts.stream([task])]
            assert result.completed, result.error
        with pytest.raises(errors.Unauthenticated):
            async with AsyncClient(report.address, token="not-the-token") as stranger:
                await stranger.node_info()
    finally:
        await actor.stop.remote()
        ray.kill(actor)


async def test_leases_are_renewed_while_the_client_lives_and_reaped_after(ray_nodes: RayNodes) -> None:
    cluster = await ClusterClient(ray_nodes.actors, lease_ttl_s=2.0).start()
    sandbox = await cluster.create_sandbox(labels={"test": "lease"})
    node = cluster.node_of(sandbox.id)
    assert node is not None and sandbox.info.lease_ttl == 2.0
    await asyncio.sleep(4.5)  # more than twice the TTL: only the background renewal keeps it
    assert (await sandbox.exec(["true"], timeout=10)).exit_code == 0
    await cluster.close()  # the client is gone (as if it crashed): nobody renews the lease
    async with AsyncClient(node.address) as direct:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                await direct.get_sandbox(sandbox.id)
            except errors.SandboxNotFound:
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail(f"sandbox {sandbox.id} outlived its lease")


async def test_a_create_whose_answer_is_lost_is_retried_without_a_second_sandbox(
    ray_nodes: RayNodes, monkeypatch
) -> None:
    async with ClusterClient(ray_nodes.actors) as cluster:
        lost_answers: list[str] = []

        def lose_the_first_two_answers(node_client: AsyncClient) -> None:
            real_create = node_client.create_sandbox

            async def create(*args: Any, **kwargs: Any) -> Any:
                sandbox = await real_create(*args, **kwargs)
                if len(lost_answers) < 2:  # the daemon made it; the reply never arrived
                    lost_answers.append(sandbox.id)
                    raise errors.Unavailable("injected: connection reset before the reply")
                return sandbox

            monkeypatch.setattr(node_client, "create_sandbox", create)

        for node in cluster.nodes.values():
            lose_the_first_two_answers(node.client)
        sandbox = await cluster.create_sandbox(labels={"test": "idempotent"})
        try:
            assert lost_answers == [sandbox.id, sandbox.id]
            counts = await _sandboxes_by_node(ray_nodes, cluster, "idempotent")
            assert sum(counts.values()) == 1
        finally:
            await sandbox.destroy()


def _quick_task(task_id: str) -> Any:
    """A rollout of one sandbox, one generation (submit) and an evaluation that passes."""
    return repair_task(task_id, eval_command="true", solution=[call("submit")])


@dataclass
class Victim:
    """The processes of the node a test is about to break."""

    daemon_pid: int
    daemon_id: str
    actor_pid: int


@contextlib.asynccontextmanager
async def _streaming_cluster(
    ray_nodes: RayNodes, tasks: list[Any], victim: int
) -> AsyncIterator[tuple[ClusterClient, str, Victim]]:
    """A client of every node with a replay LLM server for `tasks` registered (and its URL), and
    the node a test is about to break."""
    async with replay_server(tasks) as server, ClusterClient(ray_nodes.actors, poll_interval_s=0.5) as cluster:
        await cluster.rollouts.register_llm(server.url)
        report = await ray_nodes.actors[victim].report.remote()
        assert report.daemon_pid is not None and report.info is not None
        yield cluster, server.url, Victim(report.daemon_pid, report.info.daemon_id, report.actor_pid)


async def test_a_daemon_crash_mid_stream_reruns_its_rollouts_elsewhere_when_asked(ray_nodes: RayNodes) -> None:
    tasks = [_quick_task(f"rerun-{i}") for i in range(RERUN_TASKS)]
    victim = 1
    victim_id = ray_nodes.node_ids[victim]
    logged = _log_sizes(ray_nodes)
    async with _streaming_cluster(ray_nodes, tasks, victim) as (cluster, llm_url, doomed):
        results = []
        async with cluster.rollouts.open_stream(resubmit_lost=True) as stream:
            for task in tasks:
                await stream.submit(task, n=RERUN_SAMPLES)
            stream.close_input()
            async for result in stream:
                results.append(result)
                if len(results) == 10:
                    os.kill(doomed.daemon_pid, signal.SIGKILL)  # the daemon alone: its actor lives on
        # Each sample once, completed, the samples of a task under one group id, some of them run
        # twice.
        assert collections.Counter((r.task_id, r.sample_index) for r in results) == {
            (t.task_id, i): 1 for t in tasks for i in range(RERUN_SAMPLES)
        }
        assert all(r.completed and r.reward == 1.0 for r in results), [
            (r.task_id, r.status, r.filter_reason, r.error) for r in results if not r.completed
        ]
        # Nor was any of them refused for room and saved by a retry: the nodes' rollouts wait for
        # room among their own sandboxes, however slowly those are torn down.
        assert _refused_for_room_since(ray_nodes, logged) == []
        groups = collections.defaultdict(set)
        for r in results:
            groups[r.task_id].add(r.group_id)
        assert all(len(g) == 1 for g in groups.values())
        assert 2 in stream.ledger.attempts.values()
        # The actor restarted the daemon; the node comes back, with the LLM server given again.
        deadline = time.monotonic() + RESTART_DEADLINE_S
        while cluster.nodes[victim_id].lost and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not cluster.nodes[victim_id].lost
        assert cluster.nodes[victim_id].report.restarts == 1
        assert [s.address for s in await cluster.nodes[victim_id].client.rollouts.list_llms()] == [llm_url]


async def test_a_node_killed_mid_stream_loses_nothing(ray_nodes: RayNodes) -> None:
    tasks = [_quick_task(f"loss-{i}") for i in range(ROLLOUTS)]
    victim = 2
    victim_id = ray_nodes.node_ids[victim]
    logged = _log_sizes(ray_nodes)
    async with _streaming_cluster(ray_nodes, tasks, victim) as (cluster, _, doomed):
        results = []
        began = time.monotonic()
        async for result in cluster.rollouts.stream(tasks):
            results.append(result)
            if len(results) == ROLLOUTS // 4:
                # The node dies at once: its daemon (as in a power cut), its CorralNode (which would
                # otherwise start the daemon again) and its raylet.
                os.kill(doomed.daemon_pid, signal.SIGKILL)
                os.kill(doomed.actor_pid, signal.SIGKILL)
                ray_nodes.cluster.remove_node(ray_nodes.raylets[victim], allow_graceful=False)
        elapsed = time.monotonic() - began

        # Every rollout ends exactly once: completed, or filtered because its node was lost.
        assert len(results) == ROLLOUTS, elapsed
        assert collections.Counter(r.task_id for r in results) == {t.task_id: 1 for t in tasks}
        outcomes = collections.Counter((r.status, r.filter_reason) for r in results)
        assert set(outcomes) <= {("completed", None), ("filtered", "node_lost")}, outcomes
        lost = [r for r in results if r.filter_reason == "node_lost"]
        assert lost and all(victim_id in r.error for r in lost), outcomes
        assert cluster.nodes[victim_id].lost
        assert all(r.reward == 1.0 for r in results if r.completed)
        assert _refused_for_room_since(ray_nodes, logged) == []

        # Nothing is left on the surviving nodes.
        for node_id in ray_nodes.node_ids[:victim]:
            node = cluster.nodes[node_id]
            assert await node.client.list_sandboxes() == []
            assert (await node.client.node_info()).capacity.running == 0

    # The dead node's sandboxes go when it returns: a daemon on its state directory reaps them.
    returned = DaemonSupervisor(ray_nodes.roots[victim], NODE_CONFIG.format(cap=NODE_CAPS[victim]))
    returned.start()
    try:
        assert alive_pids(sandbox_pids(doomed.daemon_id)) == set()
    finally:
        returned.stop()
