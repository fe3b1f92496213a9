"""corral on a Ray cluster: what placement through `corral.cluster.ClusterClient` adds to a
sandbox and to a rollout, against a direct client of the same daemon, and rollouts/s with 1, 2
and 3 nodes.

The nodes are raylets of one Ray cluster on this machine (ray.cluster_utils.Cluster, one CPU and a
small object store each), each with its CorralNode actor and its own daemon (local backend). They
share the machine's cores, so the throughput rows show what the cluster client costs, not how it
scales: more nodes here means more daemons on the same CPUs.

Variants (latency: alternating blocks, one at a time, so that each call is one placement):
  direct_create       AsyncClient(node 0).create_sandbox(image="host") until it answers
  cluster_create      ClusterClient.create_sandbox(image="host") (placement, then the chosen
                      daemon's create); each sandbox is destroyed after, untimed
  placement_only      the placement decision itself (Placer.choose + claim, in process, no I/O)
  direct_rollout      one rollout over a single-node AsyncClient stream: submit, then its result
  cluster_rollout     one rollout over a ClusterRolloutStream (placement, the node's stream)
The latency rows use node 0 alone (the cluster client over that one node), so that they differ
only by the cluster client; placement_only decides among the three nodes.
Throughput: `--rollouts` rollouts per row (one sandbox, one generation, an evaluation), in two
rounds of half as many streamed at once, the rows alternating:
  direct_1_node       AsyncClient.rollouts.stream on node 0
  cluster_N_nodes     ClusterClient.rollouts.stream over the first N nodes, N = 1, 2, 3

The LLM is the built-in reference server (replay policy, no latency), so a rollout is the
machine's own work: sandbox start, one turn, the evaluation, the teardown.

Usage: python bench/cluster.py [--quick] [--json PATH] [--rollouts N]
Needs root (local sandboxes) and the extra corral[ray].
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from _common import parse_args, print_header, print_ratios, print_table, ratios, summary, write_json

MIB = 1 << 20
NODE_CONFIG = "[daemon]\nmemory_overcommit = 0.0\n"


def make_task(task_id: str):
    from corral.v1 import rollout_pb2 as pb

    task = pb.Task(task_id=task_id)
    task.prompt.messages.add(role="user", content=f"[{task_id}] submit.")
    task.reference_solution.add(name="submit", arguments_json="{}")
    task.evaluation.commands.append("true")
    task.evaluation.exit_status.SetInParent()
    return task


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return (time.perf_counter() - start) * 1000


async def interleaved(variants: dict[str, Callable[[], Awaitable[float]]], n: int, blocks: int = 10) -> dict:
    """Each variant `n` times, in alternating blocks; each call returns its own milliseconds."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for block in range(1, blocks + 1):
        for name, fn in variants.items():
            while len(samples[name]) < n * block // blocks:
                samples[name].append(await fn())
    return samples


async def measure(args, actors) -> tuple[dict, dict]:
    from corral.cluster import ClusterClient
    from corral.rollout.reference.replay import ReplayPolicy
    from corral.rollout.reference.server import ReferenceServer
    from corral.sdk import AsyncClient, RolloutResult

    n = 20 if args.quick else 60
    rollouts = args.rollouts or (60 if args.quick else 200)
    rounds = 2
    latency_tasks = [make_task(f"lat-{i}") for i in range(2 * n + 10)]
    rows = ["direct_1_node", "cluster_1_nodes", "cluster_2_nodes", "cluster_3_nodes"]
    batches = {
        (row, r): [make_task(f"{row}-{r}-{i}") for i in range(rollouts // rounds)]
        for row in rows
        for r in range(rounds)
    }
    server = ReferenceServer(ReplayPolicy(latency_tasks + [t for batch in batches.values() for t in batch]))
    await server.start()
    clusters = {count: ClusterClient(actors[:count], lease_ttl_s=None) for count in (1, 2, 3)}
    # The latency rows compare the same daemon (node 0) with and without the cluster client.
    direct = AsyncClient((await actors[0].report.remote()).address)
    try:
        for cluster in clusters.values():
            await cluster.start()
        await clusters[3].rollouts.register_llm(server.url)
        cluster = clusters[1]

        async def direct_create() -> float:
            created: list[Any] = []
            ms = await timed(lambda: _append(created, direct.create_sandbox(image="host")))
            await created[0].destroy()
            return ms

        async def cluster_create() -> float:
            created: list[Any] = []
            ms = await timed(lambda: _append(created, cluster.create_sandbox(image="host")))
            await created[0].destroy()
            return ms

        async def placement_only() -> float:
            placer = clusters[3].placer
            start = time.perf_counter()
            slot = placer.choose("host")
            assert slot is not None
            placer.claim(slot)
            ms = (time.perf_counter() - start) * 1000
            placer.release(slot)
            return ms

        tasks = iter(latency_tasks)
        direct_stream = direct.rollouts.open_stream()
        cluster_stream = cluster.rollouts.open_stream()

        async def direct_rollout() -> float:
            async def one() -> None:
                await direct_stream.submit(next(tasks))
                result = await direct_stream.__anext__()
                assert isinstance(result, RolloutResult) and result.completed, result

            return await timed(one)

        async def cluster_rollout() -> float:
            async def one() -> None:
                await cluster_stream.submit(next(tasks))
                result = await cluster_stream.__anext__()
                assert result.completed, result.error

            return await timed(one)

        for fn in (direct_create, cluster_create, direct_rollout, cluster_rollout):
            await fn()  # warm-up: channels, first sandbox of each path
        samples = await interleaved(
            {
                "direct_create": direct_create,
                "cluster_create": cluster_create,
                "placement_only": placement_only,
                "direct_rollout": direct_rollout,
                "cluster_rollout": cluster_rollout,
            },
            n,
        )
        await direct_stream.close()
        await cluster_stream.close()
        results = {name: summary(values) for name, values in samples.items()}

        # Throughput: every row streams its batch at once, the rows in alternating rounds.
        spent = dict.fromkeys(rows, 0.0)
        done = dict.fromkeys(rows, 0)
        for r in range(rounds):
            for row in rows:
                if row == "direct_1_node":
                    stream = direct.rollouts.stream(batches[row, r])
                else:
                    stream = clusters[int(row.split("_")[1])].rollouts.stream(batches[row, r])
                start = time.perf_counter()
                async for result in stream:
                    assert isinstance(result, RolloutResult) and result.completed, result
                    done[row] += 1
                spent[row] += time.perf_counter() - start
        throughput = {row: round(done[row] / spent[row], 2) for row in rows}
    finally:
        await direct.close()
        for cluster in clusters.values():
            await cluster.close()
        await server.stop()
    return results, throughput


async def _append(into: list, creating: Awaitable[object]) -> None:
    into.append(await creating)


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], lambda p: p.add_argument("--rollouts", type=int, default=0))
    import ray
    from ray.cluster_utils import Cluster

    from corral.cluster import start_node

    print_header("bench/cluster.py: ClusterClient placement against a direct client; rollouts/s over 1-3 nodes")
    small: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 75 * MIB}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    actors = []
    try:
        for _ in range(2):
            cluster.add_node(**small)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        node_ids = [raylet.node_id for raylet in cluster.list_all_nodes()]
        roots = [tempfile.mkdtemp(prefix="corral-bench-node-") for _ in node_ids]
        actors = [start_node(nid, root=root, config_text=NODE_CONFIG) for nid, root in zip(node_ids, roots)]
        ray.get([a.report.remote() for a in actors])
        results, throughput = asyncio.run(measure(args, actors))
    finally:
        for actor in actors:
            ray.get(actor.stop.remote())
        ray.shutdown()
        cluster.shutdown()
    pairs = [("cluster_create", "direct_create"), ("cluster_rollout", "direct_rollout")]
    ratio_values = ratios(results, pairs)
    overhead = {
        "create_p50_ms": round(results["cluster_create"]["p50_ms"] - results["direct_create"]["p50_ms"], 3),
        "rollout_p50_ms": round(results["cluster_rollout"]["p50_ms"] - results["direct_rollout"]["p50_ms"], 3),
    }
    print_table("latency (ms)", results)
    print_ratios(ratio_values)
    print(f"  overhead (p50 difference): {overhead}")
    print("\nrollouts/s (nodes share this machine's CPUs: overhead, not scaling)")
    for name, value in throughput.items():
        print(f"  {name:<16} {value:>8.2f}")
    load = [round(x, 2) for x in os.getloadavg()]
    print(f"\nload average at the end: {load}")
    write_json(
        args.json,
        results,
        ratio_values,
        {"rollouts_per_s": throughput, "overhead": overhead, "load_average_end": load, "cpus": os.cpu_count()},
    )


if __name__ == "__main__":
    main()
