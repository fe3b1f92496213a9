"""corral on a Ray cluster (extra `corral[ray]`): a `CorralNode` actor per node starts and watches
that node's daemon; a `ClusterClient` places sandboxes and rollouts on the nodes by free capacity
and talks to the chosen daemon directly. See docs/cluster.md.

    import ray
    from corral.cluster import ClusterClient, start_nodes

    ray.init()
    nodes = start_nodes(tcp=True)  # daemons reachable from other machines (tcp=False: this one only)
    async with ClusterClient(nodes) as cluster:
        async with cluster.create_sandbox() as sandbox:
            print((await sandbox.exec(["hostname"])).stdout)
        await cluster.rollouts.register_llm("http://10.0.0.5:30000")
        async for result in cluster.rollouts.stream(tasks, n=4):
            ...
"""

from corral.cluster.client import ClusterClient, ClusterNode, ClusterSandbox
from corral.cluster.node import CorralNode, NodeReport, start_node, start_nodes
from corral.cluster.rollouts import ClusterRollouts, ClusterRolloutStream
from corral.cluster.supervisor import DaemonSupervisor

__all__ = [
    "ClusterClient",
    "ClusterNode",
    "ClusterRolloutStream",
    "ClusterRollouts",
    "ClusterSandbox",
    "CorralNode",
    "DaemonSupervisor",
    "NodeReport",
    "start_node",
    "start_nodes",
]
