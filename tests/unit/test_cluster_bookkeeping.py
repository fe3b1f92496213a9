"""corral.cluster's placement, its ledger of owed rollouts, and its client's and supervisor's
bookkeeping, without a cluster: the per-node clients, actors and rollout streams are fakes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import require_cluster

require_cluster("ray", "ray", "ray")  # corral.cluster imports ray

from corral.cluster import client as cluster_client  # noqa: E402
from corral.cluster import rollouts as cluster_rollouts  # noqa: E402
from corral.cluster import supervisor as cluster_supervisor  # noqa: E402
from corral.cluster.client import ClusterClient  # noqa: E402
from corral.cluster.ledger import Ledger, Submission  # noqa: E402
from corral.cluster.node import NodeReport  # noqa: E402
from corral.cluster.placement import NodeSlot, Placer, slot_from_capacity  # noqa: E402
from corral.sdk import AsyncSandbox, _core  # noqa: E402
from corral.sdk.errors import InvalidArgument, NotFound, Unavailable  # noqa: E402
from corral.sdk.types import LLMServerInfo, NodeCapacity, NodeInfo, RolloutResult  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from corral.v1 import sandbox_pb2 as sandbox_pb  # noqa: E402


def _placer(**free: int) -> Placer:
    placer = Placer()
    for node_id, slots in free.items():
        placer.slots[node_id] = NodeSlot(node_id, free_at_poll=slots)
    return placer


def _place(placer: Placer, count: int, image: str | None = None) -> list[str | None]:
    chosen = []
    for _ in range(count):
        slot = placer.choose(image)
        if slot is not None:
            placer.claim(slot)
        chosen.append(slot.node_id if slot else None)
    return chosen


def test_placement_fills_by_room_and_a_full_node_gets_nothing() -> None:
    # Most room first; between nodes of equal room, the one picked least recently ("b" at the third).
    assert _place(_placer(a=3, b=1, c=0), 5) == ["a", "a", "b", "a", None]


def test_claims_made_while_a_poll_runs_stay_counted_against_its_answer() -> None:
    placer = _placer(a=4)
    slot = placer.slots["a"]
    asked_at = slot.claims  # a poll is asked for now ...
    _place(placer, 2)  # ... two placements go out meanwhile, which the daemon already counts
    slot_from_capacity(slot, NodeCapacity(free_slots=2, free_slots_default_limits=2), False, asked_at)
    assert slot.room == 0
    placer.release(slot)  # one of this client's rollouts finished: its slot is free again
    assert slot.room == 1


def test_an_image_the_node_holds_wins_over_more_room() -> None:
    placer = _placer(a=5, b=1)
    placer.slots["b"].images = frozenset({"local:/images/swe"})
    assert _place(placer, 2, image="/images/swe") == ["b", "a"]
    assert _place(placer, 1, image="other") == ["a"]


def test_lost_draining_and_refusing_nodes_get_nothing() -> None:
    placer = _placer(a=2, b=2, c=2)
    placer.slots["a"].lost = True
    placer.slots["b"].draining = True
    placer.refuse(placer.slots["c"])
    assert placer.choose() is None
    assert placer.choose_any() is placer.slots["c"]  # rollouts still go where a daemon can queue them


def _submission(group: str, node: str, n: int) -> Submission:
    return Submission(group, node, pb.Task(task_id=group), [(group, i) for i in range(n)])


def test_each_rollout_is_settled_once_and_a_lost_nodes_late_answers_are_dropped() -> None:
    ledger = Ledger()
    ledger.send(_submission("g1", "a", 2))
    ledger.send(_submission("g2", "b", 1))
    assert ledger.settle("g1", 0, "a") is not None
    assert ledger.settle("g1", 0, "a") is None  # the same answer again
    assert ledger.settle("g2", 0, "a") is None  # from a node that does not run it
    lost = ledger.lose_node("a")
    assert [key for _, key in lost] == [("g1", 1)]
    assert ledger.settle("g1", 1, "a") is None  # too late: reported lost already
    assert ledger.owed == 1 and ledger.owed_on("b") == 1


def test_a_rerun_answers_for_the_callers_group_and_index() -> None:
    ledger = Ledger()
    ledger.send(_submission("g", "a", 2))
    lost = dict((key, submission) for submission, key in ledger.lose_node("a"))
    assert set(lost) == {("g", 0), ("g", 1)}
    ledger.send(Submission("g~1~x", "b", lost[("g", 1)].task, [("g", 1)]))
    settled = ledger.settle("g~1~x", 0, "b")
    assert settled is not None and settled[1] == ("g", 1)
    assert ledger.attempts[("g", 1)] == 2 and ledger.owed == 0


# -- the cluster client over fake nodes ---------------------------------------------------------


class _FakeTransport:
    """What an AsyncSandbox of a fake node calls: RenewLease and DestroySandbox, recorded;
    `renewal_errors` are raised by the first renewals."""

    sandbox_service = SimpleNamespace(RenewLease="RenewLease", DestroySandbox="DestroySandbox")

    def __init__(self) -> None:
        self.renewals: list[int] = []  # each renewal's TTL (ms)
        self.renewal_errors: list[BaseException] = []

    async def unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        if method == "RenewLease":
            self.renewals.append(request.ttl_ms)
            if self.renewal_errors:
                raise self.renewal_errors.pop(0)
            return sandbox_pb.RenewLeaseResponse(sandbox=sandbox_pb.Sandbox(sandbox_id=request.sandbox_id))
        return sandbox_pb.DestroySandboxResponse()


class _FakeNodeRollouts:
    def __init__(self, registered: set[str], error: BaseException | None) -> None:
        self.registered = registered
        self.error = error

    async def register_llm(self, address: str, protocol: str, *, weight: int, model: str) -> LLMServerInfo:
        if self.error is not None:
            raise self.error
        self.registered.add(address)
        return LLMServerInfo(address, "sglang", weight, model, 0, True, 0, 0)

    async def remove_llm(self, address: str) -> None:
        if address not in self.registered:
            raise NotFound(f"no LLM server {address}")
        self.registered.discard(address)


class _FakeNode:
    """A node's CorralNode actor (`report.remote()`) and its daemon's client (what AsyncClient's
    constructor returns for its address)."""

    def __init__(self, node_id: str, free: int = 4, llm_error: BaseException | None = None) -> None:
        self.node_id = node_id
        self.free = free
        self.report = SimpleNamespace(remote=self._report)
        self.transport = _FakeTransport()
        self.leases: list[float | None] = []  # each create's lease_ttl_s
        self.llms: set[str] = set()
        self.rollouts = _FakeNodeRollouts(self.llms, llm_error)
        self.closed = False

    async def _report(self) -> NodeReport:
        capacity = NodeCapacity(free_slots=self.free, free_slots_default_limits=self.free)
        info = NodeInfo("0", self.node_id, "local", (), "none", 0, capacity=capacity)
        return NodeReport(self.node_id, f"unix:///nonexistent/{self.node_id}.sock", None, 0, info)

    async def create_sandbox(
        self, image: Any, backend: Any, *, lease_ttl_s: float | None, idempotency_key: str, **options: Any
    ) -> AsyncSandbox:
        self.leases.append(lease_ttl_s)
        proto = sandbox_pb.Sandbox(sandbox_id=f"{self.node_id}-{len(self.leases)}")
        return AsyncSandbox(self.transport, _core.sandbox_info_from_proto(proto))  # type: ignore[arg-type]

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_nodes(monkeypatch: pytest.MonkeyPatch) -> list[_FakeNode]:
    """Fake nodes that a ClusterClient started on them reaches (their list is filled by the test)."""
    nodes: list[_FakeNode] = []

    def client_of(address: str, **_: Any) -> _FakeNode:
        return next(n for n in nodes if address.endswith(f"/{n.node_id}.sock"))

    monkeypatch.setattr(cluster_client, "AsyncClient", client_of)
    return nodes


async def test_a_per_call_lease_is_renewed_every_third_of_its_own_ttl(fake_nodes: list[_FakeNode]) -> None:
    fake_nodes.append(_FakeNode("a"))
    # A client without a lease of its own, and one whose lease is much longer than the call's.
    for client_lease in (None, 30.0):
        node = fake_nodes[0]
        node.transport.renewals.clear()
        async with ClusterClient(fake_nodes, lease_ttl_s=client_lease, poll_interval_s=3600) as cluster:
            await cluster.create_sandbox(lease_ttl_s=0.3)
            await asyncio.sleep(0.7)
        assert node.leases[-1] == 0.3
        assert len(node.transport.renewals) >= 3 and set(node.transport.renewals) == {300}, client_lease


async def test_a_call_that_gives_no_lease_gets_none(fake_nodes: list[_FakeNode]) -> None:
    fake_nodes.append(_FakeNode("a"))
    async with ClusterClient(fake_nodes, lease_ttl_s=30.0, poll_interval_s=3600) as cluster:
        await cluster.create_sandbox(lease_ttl_s=None)
        await cluster.create_sandbox()
        await cluster.create_sandbox(lease_ttl_s=5.0)
    assert fake_nodes[0].leases == [None, 30.0, 5.0]
    with pytest.raises(InvalidArgument):
        ClusterClient(fake_nodes, lease_ttl_s=0)  # not "no lease": that is None


async def test_renewal_goes_on_after_an_error_and_close_closes_the_node_clients(fake_nodes: list[_FakeNode]) -> None:
    node = _FakeNode("a")
    fake_nodes.append(node)
    node.transport.renewal_errors = [RuntimeError("not a CorralError"), asyncio.CancelledError()]
    cluster = await ClusterClient(fake_nodes, poll_interval_s=3600).start()
    await cluster.create_sandbox(lease_ttl_s=0.15)
    await asyncio.sleep(0.5)
    assert len(node.transport.renewals) >= 4  # the two failed renewals, and more after them
    await cluster.close()
    assert node.closed


async def test_destroying_a_sandbox_frees_its_place_at_once(fake_nodes: list[_FakeNode]) -> None:
    fake_nodes.append(_FakeNode("a", free=2))
    async with ClusterClient(fake_nodes, poll_interval_s=3600) as cluster:
        slot = cluster.placer.slots["a"]
        async with cluster.create_sandbox() as sandbox:
            await cluster.create_sandbox(lease_ttl_s=None)
            assert slot.room == 0
        assert slot.room == 1  # no poll since: the client counted its own destroy
        assert cluster.node_of(sandbox.id) is None


async def test_an_llm_server_is_kept_for_returning_nodes_after_a_partial_failure(fake_nodes: list[_FakeNode]) -> None:
    fake_nodes += [_FakeNode("a"), _FakeNode("b", llm_error=Unavailable("b is restarting"))]
    async with ClusterClient(fake_nodes, poll_interval_s=3600) as cluster:
        with pytest.raises(Unavailable):
            await cluster.rollouts.register_llm("http://llm:1")
        assert "http://llm:1" in cluster.llms  # b gets it when it comes back (ClusterClient._rejoin)
        assert fake_nodes[0].llms == {"http://llm:1"}
        await cluster.rollouts.remove_llm("http://llm:1")  # b never had it: not an error
        assert fake_nodes[0].llms == set() and "http://llm:1" not in cluster.llms
        with pytest.raises(NotFound):
            await cluster.rollouts.remove_llm("http://llm:1")  # no node has it


class _FakeNodeStream:
    """A node's rollout stream: records the submits; the test answers through `events`."""

    opened: dict[str, _FakeNodeStream] = {}

    def __init__(self, node: Any, events: asyncio.Queue[Any]) -> None:
        self.node = node
        self.events = events
        self.sent: list[pb.StreamRequest] = []
        _FakeNodeStream.opened[node.node_id] = self

    def send(self, request: pb.StreamRequest) -> None:
        self.sent.append(request)

    def answer(self, **response: Any) -> None:
        message = pb.StreamResponse(**response)
        self.events.put_nowait((message.WhichOneof("event"), self.node, message))

    def reject(self, code: str) -> None:
        submit = self.sent[-1].submit
        self.answer(rejected=pb.RolloutRejected(client_ref=submit.client_ref, task_id=submit.task.task_id, code=code))

    async def close(self) -> None:
        pass


@pytest.fixture
def node_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, _FakeNodeStream]:
    _FakeNodeStream.opened = {}
    monkeypatch.setattr(cluster_rollouts, "_NodeStream", _FakeNodeStream)
    return _FakeNodeStream.opened


async def _all_results(stream: Any) -> list[RolloutResult]:
    return await asyncio.wait_for(_collect(stream), 5)


async def _collect(stream: Any) -> list[RolloutResult]:
    return [result async for result in stream]


async def test_rollouts_a_draining_node_rejects_come_back_node_lost_when_no_node_takes_them(
    fake_nodes: list[_FakeNode], node_streams: dict[str, _FakeNodeStream]
) -> None:
    fake_nodes.append(_FakeNode("a"))
    async with ClusterClient(fake_nodes, poll_interval_s=3600) as cluster:
        async with cluster.rollouts.open_stream() as stream:
            await stream.submit(pb.Task(task_id="t"), n=2, group_id="g")
            node_streams["a"].reject("UNAVAILABLE")
            stream.close_input()
            results = await _all_results(stream)
    assert sorted((r.group_id, r.sample_index) for r in results) == [("g", 0), ("g", 1)]
    assert {(r.status, r.filter_reason) for r in results} == {("filtered", "node_lost")}


async def test_a_rejection_affects_only_its_own_rollouts(
    fake_nodes: list[_FakeNode], node_streams: dict[str, _FakeNodeStream]
) -> None:
    fake_nodes += [_FakeNode("a"), _FakeNode("b")]
    async with ClusterClient(fake_nodes, poll_interval_s=3600) as cluster:
        async with cluster.rollouts.open_stream() as stream:
            await stream.submit(pb.Task(task_id="t1"), group_id="g1")
            await stream.submit(pb.Task(task_id="t2"), group_id="g2")  # the other node: equal room
            stream.close_input()
            rejecting, answering = node_streams["a"], node_streams["b"]
            rejecting.reject("FAILED_PRECONDITION")  # e.g. a restarted daemon without LLM servers
            answered = answering.sent[-1].submit
            answering.answer(
                result=pb.RolloutResult(
                    rollout_id="r",
                    task_id=answered.task.task_id,
                    group_id=answered.options.group_id,
                    status=pb.ROLLOUT_STATUS_COMPLETED,
                )
            )
            results = {r.task_id: r for r in await _all_results(stream)}
    rejected_task = rejecting.sent[-1].submit.task.task_id
    assert results[rejected_task].status == "filtered" and "rejected" in results[rejected_task].error
    assert results[answered.task.task_id].status == "completed"


# -- the daemon supervisor ----------------------------------------------------------------------


def test_a_restart_that_does_not_come_up_counts_toward_max_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Launches in turn: a daemon that serves and exits, one that dies before serving, one that serves
    # and stays. Supervision goes on past the failed restart.
    scripts = [
        "import time; time.sleep(0.3); raise SystemExit(1)",
        "raise SystemExit(2)",
        "import time; time.sleep(60)",
    ]
    serves = [True, False, True]
    launched: list[bool] = []

    def popen(command: list[str], **options: Any) -> subprocess.Popen[bytes]:
        launched.append(serves[len(launched)])
        return subprocess.Popen([sys.executable, "-c", scripts[len(launched) - 1]], stdout=options["stdout"])

    fake_subprocess = SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(cluster_supervisor, "subprocess", fake_subprocess)
    monkeypatch.setattr(cluster_supervisor, "serving", lambda address, timeout=1.0: launched[-1])
    supervisor = cluster_supervisor.DaemonSupervisor(tmp_path, max_restarts=3, start_timeout_s=5)
    supervisor.socket.touch()
    supervisor.start()
    try:
        deadline = time.monotonic() + 10
        while len(launched) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert supervisor.failure == "" and supervisor.restarts == 2 and supervisor.pid is not None
    finally:
        supervisor.stop(timeout_s=5)
