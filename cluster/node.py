"""`CorralNode`: the Ray actor that stands for one node's corral daemon.

One per node, pinned to it (NodeAffinitySchedulingStrategy, not soft: it never runs elsewhere).
It starts and supervises a daemon of its own (own socket, state directory and configuration;
cluster/supervisor.py), or attaches to one already there (the systemd unit's socket). Clients
poll `report()` for the daemon's address and capacity; everything else (sandboxes, turns,
rollout streams) goes from the client to the daemon directly, never through Ray.

Ray fixes a node's custom resources when the node starts, so the capacity, which changes with
every sandbox, is published by `report()` rather than as a resource; `start_nodes` can add a
static `corral` resource to the actor's request so that Ray places it only where it is declared.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from corral.cluster.supervisor import DaemonSupervisor
from corral.sdk import Client, CorralError
from corral.sdk.types import NodeInfo

# Where the actors are found by name (ClusterClient.from_ray): "corral-node-<Ray node id>".
NAMESPACE = "corral"
ACTOR_PREFIX = "corral-node-"


@dataclass(frozen=True)
class NodeReport:
    """One poll of a node: where its daemon listens and what it has room for."""

    node_id: str
    # The address clients use: the daemon's TCP listener when it has one, else its Unix socket
    # (reachable from this machine only), with the bearer token the TCP listener wants.
    address: str
    # The daemon's process id when this actor supervises it (None: attached, or not running).
    daemon_pid: int | None
    restarts: int
    # GetNodeInfo's answer; None with `error` set when the daemon did not answer.
    info: NodeInfo | None
    error: str = ""
    token: str | None = field(default=None, repr=False)
    # The actor's own process (its Ray worker).
    actor_pid: int = 0


class CorralNode:
    """A node's daemon, started (`root`, `config_text`; with `tcp_host`, also listening on TCP
    there for clients on other machines) or attached to (`attach_address`, a Unix socket of this
    machine, e.g. the systemd unit's /run/corral/corral.sock; `attach_token` for a TCP one)."""

    def __init__(
        self,
        *,
        root: str | None = None,
        config_text: str = "",
        tcp_host: str | None = None,
        attach_address: str | None = None,
        attach_token: str | None = None,
        max_restarts: int = 5,
    ) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self._supervisor: DaemonSupervisor | None = None
        self.token = attach_token
        if attach_address is not None:
            self.address = self._local_address = attach_address
        else:
            root = root or tempfile.mkdtemp(prefix=f"corral-node-{self.node_id[:12]}-")
            self._supervisor = DaemonSupervisor(root, config_text, tcp_host=tcp_host, max_restarts=max_restarts)
            self._supervisor.start()
            self._local_address = self._supervisor.address
            self.address = self._supervisor.tcp_address or self._local_address
            self.token = self._supervisor.token
        self._client = Client(self._local_address, token=attach_token, timeout=10.0)
        self._client.node_info()  # an attached address that serves nothing fails here

    def report(self) -> NodeReport:
        supervisor = self._supervisor
        pid = supervisor.pid if supervisor else None
        restarts = supervisor.restarts if supervisor else 0
        try:
            info = self._client.node_info()
        except CorralError as error:
            reason = supervisor.failure if supervisor and supervisor.failure else str(error)
            return NodeReport(self.node_id, self.address, pid, restarts, None, reason, self.token, os.getpid())
        return NodeReport(self.node_id, self.address, pid, restarts, info, token=self.token, actor_pid=os.getpid())

    def stop(self) -> None:
        """Stops a daemon this actor started (its sandboxes are destroyed); an attached one stays."""
        self._client.close()
        if self._supervisor is not None:
            self._supervisor.stop()


_CorralNodeActor = ray.remote(CorralNode)


def actor_name(node_id: str) -> str:
    return ACTOR_PREFIX + node_id


def start_node(
    node_id: str,
    *,
    root: str | None = None,
    config_text: str = "",
    tcp_host: str | None = None,
    attach_address: str | None = None,
    attach_token: str | None = None,
    resources: dict[str, float] | None = None,
    name: str | None = None,
) -> Any:
    """Starts the CorralNode actor on the Ray node `node_id`, named for it in NAMESPACE, and
    returns its handle. It takes no CPU (the daemon's sandboxes are the node's work, not Ray's)
    and is never restarted elsewhere: a node that dies is lost, and its replacement gets a new
    actor."""
    actor = _CorralNodeActor.options(
        name=name or actor_name(node_id),
        namespace=NAMESPACE,
        num_cpus=0,
        resources=resources or {},
        max_concurrency=4,  # reports answer while a slow one waits on the daemon
        max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )
    return actor.remote(
        root=root, config_text=config_text, tcp_host=tcp_host, attach_address=attach_address, attach_token=attach_token
    )


def start_nodes(
    *,
    config_text: str = "",
    root_dir: str | None = None,
    tcp: bool = False,
    resources: dict[str, float] | None = None,
) -> list[Any]:
    """A CorralNode on every live Ray node, each starting its own daemon (under `root_dir`/<node
    id> when given; with `tcp`, listening on the node's address too, as clients on other machines
    need), ready when this returns."""
    handles = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        node_id = node["NodeID"]
        root = os.path.join(root_dir, node_id[:12]) if root_dir else None
        tcp_host = node["NodeManagerAddress"] if tcp else None
        handles.append(start_node(node_id, root=root, config_text=config_text, tcp_host=tcp_host, resources=resources))
    ray.get([h.report.remote() for h in handles])
    return handles
