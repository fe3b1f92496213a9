"""`ClusterClient`: the asyncio client of many nodes' corral daemons, placed by Ray.

It mirrors `corral.sdk.AsyncClient` (create_sandbox, get_sandbox, list_sandboxes, rollouts): each
sandbox or rollout goes to the node with the most room (cluster/placement.py), and from then on
the caller talks to that node's daemon directly: the handle create_sandbox returns is the node's
own `AsyncSandbox` (a `ClusterSandbox`, whose destroy also frees its place in placement), so commands, shells, kernels and files never pass through Ray. Ray serves to
find the nodes and to watch them: a background poll of each node's CorralNode actor (once a
second by default) refreshes capacity and notices a node that died.

Creates carry an idempotency key (the caller's, or a fresh one per call), so retrying a create
whose answer was lost returns the sandbox made the first time, never a second one. Sandboxes get
a lease by default, each renewed in the background every third of its own TTL while this client
lives: a crashed trainer leaks nothing past one lease TTL. Destroying a sandbox through the handle
this client gave frees its place in placement's count at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from corral.cluster.node import ACTOR_PREFIX, NAMESPACE, NodeReport
from corral.cluster.placement import NodeSlot, Placer, slot_from_capacity
from corral.cluster.rollouts import ClusterRollouts
from corral.sdk import AsyncClient, AsyncSandbox, SandboxInfo
from corral.sdk._async_transport import AsyncTransport, AwaitableContext
from corral.sdk.errors import (
    AlreadyExists,
    CorralError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SandboxNotFound,
    Unavailable,
)

_log = logging.getLogger(__name__)

# Create attempts on one node whose answer did not arrive (the same idempotency key each time).
CREATE_ATTEMPTS_PER_NODE = 3


class _ClientLease(enum.Enum):
    """create_sandbox's `lease_ttl_s` when the call does not give one: the client's lease (None
    given means no lease, as AsyncClient.create_sandbox's)."""

    DEFAULT = enum.auto()


@dataclass
class ClusterNode:
    """One node as the client sees it: its actor, its daemon's client, its placement slot."""

    node_id: str
    actor: Any  # ray.actor.ActorHandle of its CorralNode
    address: str
    client: AsyncClient
    slot: NodeSlot
    report: NodeReport

    @property
    def lost(self) -> bool:
        return self.slot.lost


@dataclass
class _Placed:
    """A sandbox this client created: where, and its lease (renewed every third of it)."""

    node: ClusterNode
    sandbox: AsyncSandbox
    lease_ttl_s: float | None
    renew_at: float = 0.0  # time.monotonic() of its next renewal


def _due_by(now: float, placed: _Placed) -> bool:
    return placed.renew_at <= now


class ClusterSandbox(AsyncSandbox):
    """The node's own sandbox handle (everything goes to its daemon directly); destroying it also
    frees its place in the cluster client's placement count."""

    def __init__(self, transport: AsyncTransport, info: SandboxInfo, on_destroyed: Callable[[str], None]) -> None:
        super().__init__(transport, info)
        self._on_destroyed = on_destroyed

    async def destroy(self) -> None:
        await super().destroy()
        self._on_destroyed(self.id)


class ClusterClient:
    """A client of the corral daemons of a Ray cluster's nodes (their CorralNode actors).

    `nodes`: the actors (cluster.start_nodes' handles); `from_ray()` finds them by name instead.
    `lease_ttl_s`: the lease of each sandbox created without one of its own (None: no lease unless
    the call asks); each sandbox's lease is renewed every third of its own TTL. `poll_interval_s`: how often each node's capacity and
    liveness are asked for. Use as `async with ClusterClient(...) as cluster:`, or `await start()`
    and `await close()`.
    """

    def __init__(
        self,
        nodes: Sequence[Any],
        *,
        lease_ttl_s: float | None = 30.0,
        poll_interval_s: float = 1.0,
        timeout: float = 60.0,
    ) -> None:
        if lease_ttl_s is not None and lease_ttl_s <= 0:
            raise InvalidArgument(f"lease_ttl_s must be a positive number of seconds or None, got {lease_ttl_s}")
        self._actors = list(nodes)
        self.lease_ttl_s = lease_ttl_s
        self.poll_interval_s = poll_interval_s
        self._timeout = timeout
        self.placer = Placer()
        self.nodes: dict[str, ClusterNode] = {}
        self._placed: dict[str, _Placed] = {}  # by sandbox id
        self._leases_changed = asyncio.Event()  # a lease to renew sooner than the renewal sleeps
        self._loss_listeners: list[Callable[[ClusterNode, str], None]] = []
        # What every node's rollout service must know (ClusterRollouts), given again to a node
        # whose daemon comes back: address -> (protocol, weight, model); the policy version.
        self.llms: dict[str, tuple[str, int, str]] = {}
        self.policy_version: int | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_ray(cls, **options: Any) -> ClusterClient:
        """A client of the CorralNode actors of every live Ray node that has one."""
        actors = []
        for node in ray.nodes():
            if node["Alive"]:
                with contextlib.suppress(ValueError):
                    actors.append(ray.get_actor(ACTOR_PREFIX + node["NodeID"], namespace=NAMESPACE))
        return cls(actors, **options)

    @property
    def rollouts(self) -> ClusterRollouts:
        """Every node's RolloutService: LLM servers registered on all, rollouts placed on one."""
        return ClusterRollouts(self)

    # -- nodes ------------------------------------------------------------------------------------

    async def start(self) -> ClusterClient:
        reports = await asyncio.gather(*(actor.report.remote() for actor in self._actors))
        for actor, report in zip(self._actors, reports):
            node = ClusterNode(
                node_id=report.node_id,
                actor=actor,
                address=report.address,
                client=AsyncClient(report.address, token=report.token, timeout=self._timeout),
                slot=NodeSlot(report.node_id),
                report=report,
            )
            self.nodes[node.node_id] = node
            self.placer.slots[node.node_id] = node.slot
            self._take_report(node, report, node.slot.claims)
        self._tasks.append(asyncio.create_task(self._poll_forever()))
        self._tasks.append(asyncio.create_task(self._renew_forever()))
        return self

    def live_nodes(self) -> list[ClusterNode]:
        return [n for n in self.nodes.values() if not n.lost]

    def on_node_lost(self, listener: Callable[[ClusterNode, str], None]) -> Callable[[], None]:
        """Calls `listener(node, reason)` when a node is found lost; returns the unsubscriber."""
        self._loss_listeners.append(listener)
        return lambda: self._loss_listeners.remove(listener)

    def mark_lost(self, node: ClusterNode, reason: str) -> None:
        """Takes a node out of placement and tells the listeners (its streams) it is gone. A node
        whose actor reports its daemon serving again comes back into placement."""
        if node.slot.lost:
            return
        node.slot.lost = True
        _log.warning("corral node %s lost: %s", node.node_id, reason)
        for listener in list(self._loss_listeners):
            listener(node, reason)

    async def poll(self) -> None:
        """Asks every node for its capacity now (the background poll does it periodically)."""
        await asyncio.gather(*(self._poll_node(n) for n in self.nodes.values()))

    async def _poll_node(self, node: ClusterNode) -> None:
        claims = node.slot.claims
        try:
            report = await asyncio.wait_for(
                node.actor.report.remote(), timeout=min(30.0, max(5.0, 5 * self.poll_interval_s))
            )
        except RayActorError as error:
            self.mark_lost(node, f"its CorralNode actor died: {error}")
            return
        except (TimeoutError, RayError) as error:
            _log.warning("corral node %s did not report: %r", node.node_id, error)
            node.slot.free_at_poll = 0  # unanswered: nothing new goes there until it answers
            return
        if report.info is not None and (node.lost or report.restarts != node.report.restarts):
            # Its daemon came back (restarted by its actor): it knows none of the LLM servers.
            if report.restarts != node.report.restarts:
                self.mark_lost(node, f"its daemon was restarted ({report.restarts} restarts)")
            try:
                await self._rejoin(node)
            except CorralError as error:
                _log.warning("corral node %s came back but could not be set up: %s", node.node_id, error)
                return
        self._take_report(node, report, claims)

    async def _rejoin(self, node: ClusterNode) -> None:
        """Gives a returning node's daemon what the others were told: LLM servers, policy version."""
        for address, (protocol, weight, model) in self.llms.items():
            with contextlib.suppress(AlreadyExists):
                await node.client.rollouts.register_llm(address, protocol, weight=weight, model=model)
        if self.policy_version is not None:
            await node.client.rollouts.set_policy_version(self.policy_version)

    def _take_report(self, node: ClusterNode, report: NodeReport, claims_when_asked: int) -> None:
        node.report = report
        if report.info is None:
            self.mark_lost(node, f"its daemon does not answer: {report.error}")
            return
        slot_from_capacity(node.slot, report.info.capacity, report.info.draining, claims_when_asked)
        if node.slot.lost:
            _log.info("corral node %s is back", node.node_id)
            node.slot.lost = False

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - one failed poll must not end the polling
                _log.exception("polling the corral nodes failed")

    # -- sandboxes --------------------------------------------------------------------------------

    def create_sandbox(
        self,
        image: str | None = None,
        backend: str | None = None,
        *,
        lease_ttl_s: float | None | _ClientLease = _ClientLease.DEFAULT,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> AwaitableContext[AsyncSandbox]:
        """AsyncClient.create_sandbox on the node with the most room (one holding `image` first);
        the same arguments. Returns that node's own handle (a ClusterSandbox: destroying it frees
        its place in placement at once). `lease_ttl_s`: the client's lease when not given, None
        for no lease, else this sandbox's own; the client renews it every third of its TTL while
        it lives. A create whose answer is lost is retried on the same
        node with the same idempotency key (so never two sandboxes); a node that refuses
        (ResourceExhausted) or stays unreachable gives way to the next. ResourceExhausted when no
        node has room."""
        lease = self.lease_ttl_s if isinstance(lease_ttl_s, _ClientLease) else lease_ttl_s
        return AwaitableContext(
            self._create_sandbox(image, backend, lease, idempotency_key or uuid.uuid4().hex, options)
        )

    async def _create_sandbox(
        self, image: str | None, backend: str | None, lease_ttl_s: float | None, key: str, options: dict[str, Any]
    ) -> AsyncSandbox:
        tried: set[str] = set()
        last_error: CorralError | None = None
        polled = False
        while True:
            slot = self.placer.choose(image, exclude=tried)
            if slot is None and not polled:
                # Full by this client's count, which does not see the sandboxes destroyed since the
                # last poll: ask the nodes once before saying no.
                polled = True
                await self.poll()
                continue
            if slot is None:
                break
            node = self.nodes[slot.node_id]
            tried.add(node.node_id)
            self.placer.claim(slot)
            try:
                sandbox = await self._create_on(node, image, backend, lease_ttl_s, key, options)
            except ResourceExhausted as error:
                self.placer.release(slot)
                self.placer.refuse(slot)
                last_error = error
                continue
            except (Unavailable, DeadlineExceeded) as error:
                self.placer.release(slot)
                last_error = error
                continue
            except BaseException:
                self.placer.release(slot)
                raise
            placed = _Placed(node, sandbox, lease_ttl_s)
            if lease_ttl_s is not None:
                placed.renew_at = time.monotonic() + lease_ttl_s / 3
                self._leases_changed.set()
            self._placed[sandbox.id] = placed
            return ClusterSandbox(sandbox._transport, sandbox.info, self._forget)
        message = "no corral node has room for another sandbox"
        if last_error is not None:
            message += f" (last refusal: {last_error})"
        retry = last_error.retry_after_s if isinstance(last_error, ResourceExhausted) else None
        raise ResourceExhausted(message, retry_after_s=retry)

    async def _create_on(
        self,
        node: ClusterNode,
        image: str | None,
        backend: str | None,
        lease_ttl_s: float | None,
        key: str,
        options: dict[str, Any],
    ) -> AsyncSandbox:
        """One node's create, tried again with the same key while its answer is lost."""
        for attempt in range(1, CREATE_ATTEMPTS_PER_NODE + 1):
            try:
                return await node.client.create_sandbox(
                    image, backend, lease_ttl_s=lease_ttl_s, idempotency_key=key, **options
                )
            except (Unavailable, DeadlineExceeded):
                if attempt == CREATE_ATTEMPTS_PER_NODE or node.lost:
                    raise
                await asyncio.sleep(0.1 * attempt)
        raise AssertionError("unreachable")

    def node_of(self, sandbox_id: str) -> ClusterNode | None:
        """The node of a sandbox this client created and has not seen go, if any."""
        placed = self._placed.get(sandbox_id)
        return placed.node if placed else None

    def _forget(self, sandbox_id: str) -> None:
        """A sandbox this client created is gone: no more renewals, and its node's slot is free."""
        placed = self._placed.pop(sandbox_id, None)
        if placed is not None:
            self.placer.release(placed.node.slot)

    async def get_sandbox(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on a sandbox of any live node (SandboxNotFound if none has it)."""
        node = self.node_of(sandbox_id)
        for candidate in [node] if node else self.live_nodes():
            with contextlib.suppress(NotFound):
                return await candidate.client.get_sandbox(sandbox_id)
        raise SandboxNotFound(f"no live corral node has sandbox {sandbox_id}")

    async def list_sandboxes(self, labels: Mapping[str, str] | None = None) -> list[SandboxInfo]:
        """Every live node's sandboxes (only those with all of `labels`)."""
        nodes = self.live_nodes()
        listings = await asyncio.gather(*(n.client.list_sandboxes(labels) for n in nodes))
        return [info for listing in listings for info in listing]

    async def renew_leases(self) -> None:
        """Renews every lease this client keeps (the background renewal renews each every third
        of its TTL); a sandbox that is gone, or whose node is, is no longer renewed. A renewal that
        fails otherwise is logged and tried again at the next."""
        await self._renew(lambda placed: True)

    async def _renew(self, due: Callable[[_Placed], bool]) -> None:
        entries = [(i, p) for i, p in self._placed.items() if p.lease_ttl_s is not None and due(p)]
        outcomes = await asyncio.gather(
            *(p.sandbox.renew_lease(p.lease_ttl_s) for _, p in entries if p.lease_ttl_s is not None),
            return_exceptions=True,
        )
        now = time.monotonic()
        for (sandbox_id, placed), outcome in zip(entries, outcomes):
            assert placed.lease_ttl_s is not None
            placed.renew_at = now + placed.lease_ttl_s / 3
            if isinstance(outcome, NotFound) or placed.node.lost:
                self._forget(sandbox_id)
            elif isinstance(outcome, BaseException):
                _log.warning(
                    "could not renew the lease of sandbox %s on %s: %r", sandbox_id, placed.node.node_id, outcome
                )

    async def _renew_forever(self) -> None:
        while True:
            renew_ats = [p.renew_at for p in self._placed.values() if p.lease_ttl_s is not None]
            delay = max(0.0, min(renew_ats) - time.monotonic()) if renew_ats else None
            self._leases_changed.clear()
            # Sleeps until the next renewal is due, or a new lease (maybe a shorter one) is added.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._leases_changed.wait(), delay)
            try:
                await self._renew(functools.partial(_due_by, time.monotonic()))
            except Exception:  # noqa: BLE001 - one failed round must not end the renewals
                _log.exception("renewing sandbox leases failed")
                await asyncio.sleep(1.0)  # not at once: what failed may fail again

    # -- lifetime ---------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stops polling and renewing and closes the connections; sandboxes stay until destroyed
        or their leases run out."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        try:
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if not isinstance(outcome, asyncio.CancelledError | type(None)):
                    _log.warning("a background task of the cluster client had failed: %r", outcome)
        finally:
            await asyncio.gather(*(n.client.close() for n in self.nodes.values()), return_exceptions=True)

    async def __aenter__(self) -> ClusterClient:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()
