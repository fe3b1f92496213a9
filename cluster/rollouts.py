"""Rollouts over a cluster: `ClusterClient.rollouts` (`ClusterRollouts`) and `ClusterRolloutStream`.

Each submission (a task's `n` samples) goes to the node with the most room, over one
RolloutService.Stream per node that the stream opens when it first needs it; the daemon runs the
rollouts as it would for a single-node client (its INIT/RUN/EVAL pools, its backpressure), and
its results are handed on as they arrive, in completion order.

When a node is lost (its stream breaks, its daemon shuts down, or the cluster client's poll finds
its actor dead), every rollout it still owed comes back at once, `filtered` with reason
`node_lost`, or, with `resubmit_lost`, runs again on another node (under the caller's group id and
sample index). Either way each rollout is reported exactly once: a late answer from a node that
was given up on is dropped (cluster/ledger.py). A submission a node rejects affects only its own
rollouts: rejected because the node drains, they go to another node, or come back `node_lost`
when no live node takes work; rejected for another reason, they come back `node_lost` with the
node's answer in `error`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from corral.cluster.ledger import Ledger, RolloutKey, Submission
from corral.sdk import rollout_messages as core
from corral.sdk._address import resolve_address, resolve_token
from corral.sdk._async_transport import AsyncBidiCall, AsyncTransport
from corral.sdk.errors import AlreadyExists, CorralError, InvalidArgument, NotFound, Unavailable
from corral.sdk.rollouts import TaskSource, _each
from corral.sdk.tasks import TaskLike, task_from
from corral.sdk.types import LLMServerInfo, RolloutResult, RolloutStats
from corral.v1 import rollout_pb2 as pb

if TYPE_CHECKING:
    from corral.cluster.client import ClusterClient, ClusterNode


# (kind, node, payload): a node stream's response ("result", "accepted", "rejected", "turn") or
# end ("lost", "ended"), a node found lost by the cluster's poll ("lost"), or a wake-up ("wake").
_Event = tuple[str, "ClusterNode | None", object]


class ClusterRollouts:
    """The RolloutService of every node: LLM servers registered on all, rollouts placed on one."""

    def __init__(self, cluster: ClusterClient) -> None:
        self._cluster = cluster

    async def register_llm(
        self, address: str, protocol: str = "sglang", *, weight: int = 1, model: str = ""
    ) -> LLMServerInfo:
        """AsyncRollouts.register_llm on every live node (each node's rollouts generate from it),
        and on nodes that come back later. A node that has it already is left as it is;
        AlreadyExists only when every node had it. Once one node has it, the cluster keeps it
        (nodes that come back get it) even if another node's call failed, whose error is raised
        then (calling again registers it where it is missing)."""
        nodes = self._cluster.live_nodes()
        if not nodes:
            raise Unavailable("no live corral node to register the LLM server with")
        outcomes = await asyncio.gather(
            *(n.client.rollouts.register_llm(address, protocol, weight=weight, model=model) for n in nodes),
            return_exceptions=True,
        )
        if any(isinstance(o, LLMServerInfo | AlreadyExists) for o in outcomes):
            self._cluster.llms[address] = (protocol, weight, model)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, AlreadyExists):
                raise outcome
        infos = [o for o in outcomes if isinstance(o, LLMServerInfo)]
        if not infos:
            raise AlreadyExists(f"LLM server {address} is registered on every node already")
        return infos[0]

    async def remove_llm(self, address: str) -> None:
        """AsyncRollouts.remove_llm on every live node that has it (nodes that come back no longer
        get it); NotFound only when no live node had it."""
        self._cluster.llms.pop(address, None)
        nodes = self._cluster.live_nodes()
        outcomes = await asyncio.gather(*(n.client.rollouts.remove_llm(address) for n in nodes), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, NotFound):
                raise outcome
        if nodes and all(isinstance(o, NotFound) for o in outcomes):
            raise NotFound(f"no live corral node has LLM server {address}")

    async def set_policy_version(self, version: int) -> int:
        """AsyncRollouts.set_policy_version on every live node (and on nodes that come back)."""
        versions = await asyncio.gather(
            *(n.client.rollouts.set_policy_version(version) for n in self._cluster.live_nodes())
        )
        self._cluster.policy_version = max(versions, default=version)
        return self._cluster.policy_version

    async def stats(self) -> dict[str, RolloutStats]:
        """Each live node's rollout statistics, by node id."""
        nodes = self._cluster.live_nodes()
        stats = await asyncio.gather(*(n.client.rollouts.stats() for n in nodes))
        return {n.node_id: s for n, s in zip(nodes, stats)}

    def open_stream(self, *, resubmit_lost: bool = False, max_attempts: int = 2) -> ClusterRolloutStream:
        """A stream to submit tasks to and read results from (see ClusterRolloutStream)."""
        return ClusterRolloutStream(self._cluster, resubmit_lost=resubmit_lost, max_attempts=max_attempts)

    async def stream(
        self,
        tasks: TaskSource,
        *,
        n: int = 1,
        max_staleness: int | None = None,
        resubmit_lost: bool = False,
        max_attempts: int = 2,
    ) -> AsyncIterator[RolloutResult]:
        """AsyncRollouts.stream over the cluster: every task (`n` samples each) placed on a node,
        each result yielded as it finishes. A rollout whose node is lost is yielded `filtered`
        (`node_lost`), or with `resubmit_lost` run again elsewhere, up to `max_attempts` runs in
        all. Leaving the loop early cancels what is unfinished."""
        if isinstance(tasks, Iterable):
            tasks = [task_from(task) for task in tasks]  # a malformed task fails before anything runs
        async with self.open_stream(resubmit_lost=resubmit_lost, max_attempts=max_attempts) as stream:

            async def submit_all() -> None:
                try:
                    async for task in _each(tasks):
                        await stream.submit(task, n=n, max_staleness=max_staleness)
                finally:
                    stream.close_input()

            submitter = asyncio.create_task(submit_all())
            try:
                async for result in stream:
                    yield result
                await submitter
            finally:
                submitter.cancel()


class _NodeStream:
    """One node's RolloutService.Stream: writes go out in order from a queue (a node that applies
    backpressure holds up only its own submissions); what comes back goes to the cluster stream's
    event queue, tagged with the node, and so does the stream's end or failure."""

    def __init__(self, node: ClusterNode, events: asyncio.Queue[_Event]) -> None:
        self.node = node
        self._events = events
        self._transport = AsyncTransport(resolve_address(node.address), resolve_token(node.report.token), 60.0)
        self._call: AsyncBidiCall = self._transport.bidi_stream(self._transport.rollout_service.Stream)
        self._outbox: asyncio.Queue[pb.StreamRequest] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    def send(self, request: pb.StreamRequest) -> None:
        self._outbox.put_nowait(request)

    async def _write(self) -> None:
        try:
            while True:
                await self._call.write(await self._outbox.get())
        except CorralError as error:
            self._events.put_nowait(("lost", self.node, f"its rollout stream failed: {error}"))

    async def _read(self) -> None:
        try:
            while (response := await self._call.read()) is not None:
                self._events.put_nowait((response.WhichOneof("event"), self.node, response))
        except CorralError as error:
            self._events.put_nowait(("lost", self.node, f"its rollout stream failed: {error}"))
        else:
            self._events.put_nowait(("ended", self.node, None))

    async def close(self) -> None:
        self._call.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._transport.close()


class ClusterRolloutStream:
    """Rollouts over a cluster's nodes: `submit` tasks, iterate for their results in completion
    order; after `close_input()` the iteration ends once every submitted rollout has its result
    (completed, filtered, node_lost included, or cancelled). Leaving `async with` (or `close()`)
    cancels every unfinished rollout on every node."""

    def __init__(self, cluster: ClusterClient, *, resubmit_lost: bool, max_attempts: int) -> None:
        self._cluster = cluster
        self._resubmit_lost = resubmit_lost
        self._max_attempts = max_attempts
        self.ledger = Ledger()
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self._streams: dict[str, _NodeStream] = {}
        self._ready: collections.deque[RolloutResult] = collections.deque()
        self._client_refs = itertools.count()
        self._by_ref: dict[str, str] = {}  # client_ref -> wire group
        self._input_closed = False
        self._unsubscribe = cluster.on_node_lost(lambda node, reason: self._events.put_nowait(("lost", node, reason)))

    async def submit(
        self, task: TaskLike, *, n: int = 1, max_staleness: int | None = None, group_id: str | None = None
    ) -> None:
        """Places `n` rollouts of a task (one group) on a node and sends them there."""
        if self._input_closed:
            raise InvalidArgument("this stream's input is closed")
        task = task_from(task)
        group = group_id or uuid.uuid4().hex
        options = core.build_options(n=n, max_staleness=max_staleness, group_id=group)
        if not self._place(task, options, [(group, i) for i in range(n)], wire_group=group):
            raise Unavailable("no live corral node to run rollouts on")

    def close_input(self) -> None:
        """No more submissions: the iteration ends after the last result."""
        self._input_closed = True
        self._wake()

    def _place(self, task: pb.Task, options: pb.RolloutOptions, keys: list[RolloutKey], wire_group: str) -> bool:
        """Sends one submission to the node with the most room (a node past its room still takes
        rollouts when none has any: its daemon queues them); False when no node is live."""
        placer = self._cluster.placer
        slot = placer.choose(task.image or None) or placer.choose_any()
        if slot is None:
            return False
        node = self._cluster.nodes[slot.node_id]
        for _ in keys:
            placer.claim(slot)
        ref = str(next(self._client_refs))
        self._by_ref[ref] = wire_group
        options.group_id = wire_group
        self.ledger.send(Submission(wire_group, node.node_id, task, keys, options=options))
        if node.node_id not in self._streams:
            self._streams[node.node_id] = _NodeStream(node, self._events)
        self._streams[node.node_id].send(core.build_submit(task, options, client_ref=ref))
        return True

    def _wake(self) -> None:
        self._events.put_nowait(("wake", None, None))

    def __aiter__(self) -> AsyncIterator[RolloutResult]:
        return self

    async def __anext__(self) -> RolloutResult:
        while not self._ready:
            if self._input_closed and self.ledger.owed == 0:
                raise StopAsyncIteration
            kind, node, payload = await self._events.get()
            if node is None:
                continue  # a wake-up: look at the input again
            if kind == "result":
                assert isinstance(payload, pb.StreamResponse)
                self._take_result(node, payload.result)
            elif kind == "accepted":
                assert isinstance(payload, pb.StreamResponse)
                self.ledger.accepted(payload.accepted.group_id, list(payload.accepted.rollout_ids))
            elif kind == "rejected":
                assert isinstance(payload, pb.StreamResponse)
                self._take_rejection(node, payload.rejected)
            elif kind in ("lost", "ended"):
                if kind == "lost" or self.ledger.owed_on(node.node_id):
                    await self._lose(node, str(payload or "its rollout stream ended with rollouts unfinished"))
        return self._ready.popleft()

    def _take_result(self, node: ClusterNode, message: pb.RolloutResult) -> None:
        settled = self.ledger.settle(message.group_id, message.sample_index, node.node_id)
        if settled is None:
            return  # answered already (lost, or run elsewhere)
        submission, key = settled
        self._cluster.placer.release(node.slot)
        if message.filter_reason == pb.FILTER_REASON_SHUTDOWN:
            # The daemon stops under it: from the cluster's side, the node goes away (and takes the
            # rest of its rollouts with it, through the loss this reports).
            reason = f"its daemon shut down: {message.error}"
            self._cluster.mark_lost(node, reason)
            self._lost_rollout(submission, key, f"node {node.node_id} was lost: {reason}")
            return
        result = core.result_from_proto(message)
        if (result.group_id, result.sample_index) != key:
            result = dataclasses.replace(result, group_id=key[0], sample_index=key[1])
        self._ready.append(result)

    def _take_rejection(self, node: ClusterNode, rejected: pb.RolloutRejected) -> None:
        """A node refused a submission: only its rollouts are affected. Refused because the node
        drains, they never started and go to another node (or come back node_lost when no node
        takes work); refused for another reason, they come back node_lost with the node's answer."""
        withdrawn = self.ledger.withdraw(self._by_ref.get(rejected.client_ref, ""))
        for _ in withdrawn:
            self._cluster.placer.release(node.slot)
        draining = rejected.code == "UNAVAILABLE"
        if draining:
            self._cluster.placer.refuse(node.slot)
            node.slot.draining = True
            reason = f"node {node.node_id} drains and no other live node takes rollouts"
        else:
            reason = f"node {node.node_id} rejected it: {core.rejection_error(rejected)}"
        for submission, key in withdrawn:
            if not (draining and self._resend(submission, key, count_attempt=False)):
                self._ready.append(_node_lost_result(submission, key, reason))

    async def _lose(self, node: ClusterNode, reason: str) -> None:
        self._cluster.mark_lost(node, reason)
        stream = self._streams.pop(node.node_id, None)
        if stream is not None:
            await stream.close()
        for submission, key in self.ledger.lose_node(node.node_id):
            self._cluster.placer.release(node.slot)
            self._lost_rollout(submission, key, f"node {node.node_id} was lost: {reason}")

    def _lost_rollout(self, submission: Submission, key: RolloutKey, reason: str) -> None:
        if self._resubmit_lost and self.ledger.attempts.get(key, 0) < self._max_attempts:
            if self._resend(submission, key, count_attempt=True):
                return
        self._ready.append(_node_lost_result(submission, key, reason))

    def _resend(self, submission: Submission, key: RolloutKey, *, count_attempt: bool) -> bool:
        """Runs one rollout again, alone, on the best live node, under a wire group of its own;
        False when no live node takes rollouts."""
        options = pb.RolloutOptions()
        options.CopyFrom(submission.options)
        options.n = 1
        wire_group = f"{key[0]}~{key[1]}~{uuid.uuid4().hex[:8]}"
        placed = self._place(submission.task, options, [key], wire_group=wire_group)
        if placed and not count_attempt:
            self.ledger.attempts[key] -= 1  # send() counted it as another attempt
        return placed

    async def close(self) -> None:
        self._input_closed = True
        self._unsubscribe()
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams))

    async def __aenter__(self) -> ClusterRolloutStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _node_lost_result(submission: Submission, key: RolloutKey, reason: str) -> RolloutResult:
    """The result of a rollout whose node was lost, or that no node would run: filtered,
    node_lost, nothing of a trajectory."""
    wire_index = submission.keys.index(key)
    ids = submission.rollout_ids
    message = pb.RolloutResult(
        rollout_id=ids[wire_index] if wire_index < len(ids) else f"{submission.task.task_id}/{key[1]}/lost",
        task_id=submission.task.task_id,
        group_id=key[0],
        sample_index=key[1],
        status=pb.ROLLOUT_STATUS_FILTERED,
        filter_reason=pb.FILTER_REASON_NODE_LOST,
        error=reason,
        metadata=submission.task.metadata,
    )
    return core.result_from_proto(message)
