"""ForkManager: ForkSandbox, and the named snapshots that forks can start from (SnapshotSandbox,
ListSnapshots, DeleteSnapshot). Children are admitted and entered in the sandbox table as
creates are (SandboxManager.admit, reserve, add), all of them or none."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass, field, replace

from corral.sdk.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable

from . import rules
from .backends.base import CannotFork, ForkPoint
from .callers import current_caller
from .config import Config
from .sandboxes import Sandbox, SandboxManager, new_sandbox_id, node_error

log = logging.getLogger(__name__)

# ForkSandbox: children per call, and the labels every child gets (its generation counts forks
# from the first sandbox: 1 for a child, 2 for a child's child).
MAX_FORK_COUNT = 64
FORK_GENERATION_LABEL = "corral.fork.generation"
FORK_PARENT_LABEL = "corral.fork.parent"
# Why a drain refuses forks too (their parent or snapshot is on this node: no "elsewhere" to name).
FORK_ELSEWHERE = "forks included"
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class NamedSnapshot:
    """A sandbox's writable filesystem kept under a name (ForkManager.snapshot). It is its
    sandbox's owner's (callers.py), and names are per owner."""

    name: str
    source: Sandbox  # a copy of its sandbox's entry as it was (settings, labels, owner; no runtime)
    point: ForkPoint
    size_bytes: int
    stored_name: str = ""  # what the backend keeps it under (ForkManager._storage_name)
    created_at: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[str, str]:
        return (self.source.owner, self.name)


class ForkManager:
    def __init__(self, config: Config, sandboxes: SandboxManager) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self._snapshots: dict[tuple[str, str], NamedSnapshot] = {}  # by (owner, name)
        self._snapshots_starting: set[tuple[str, str]] = set()
        self._stored_names: set[str] = set()  # what the backends keep them under (_storage_name)

    async def fork(
        self, sandbox_id: str, count: int, labels: dict[str, str], snapshot: str = "", lease_ttl_ms: int = 0
    ) -> list[Sandbox]:
        """`count` new sandboxes whose writable filesystem starts as a copy-on-write copy of the
        parent's at this moment (or of a named snapshot's, see `snapshot`), with its image,
        limits, network, env, user, mounts and labels (plus `labels` and the fork's generation and
        parent); its processes are not copied. All of them or none: a fork that fails, or is
        cancelled (its caller's deadline passed), leaves no child and no fork point behind.

        A fork is `count` creates to admission: refused while the node drains (UNAVAILABLE), and
        `count` sandboxes against daemon.max_sandboxes, the memory and the pace caps of
        [admission] (CreateGate). Children have a lease of `lease_ttl_ms` (0: none; never the
        parent's, which a fork does not take over) and no idempotency key."""
        self.sandboxes.check_open()
        if not 1 <= count <= MAX_FORK_COUNT:
            raise InvalidArgument(f"count must be between 1 and {MAX_FORK_COUNT}, got {count}")
        if bool(sandbox_id) == bool(snapshot):
            raise InvalidArgument("give either a sandbox id or a snapshot name to fork")
        lease_ttl_s = rules.lease_ttl_s(self.config.leases, lease_ttl_ms)
        if snapshot:
            named = self._find_snapshot(snapshot)
            return await self._make_children(named.source, named.point, count, labels, lease_ttl_s)
        with self.sandboxes.using(sandbox_id) as parent:
            source = _settings_of(parent)
            impl = self.sandboxes.backends[source.backend]
            # Refused before the fork point is made (the parent pauses for it), and checked again
            # once it is (_make_children).
            self.sandboxes.admit(count, source.limits.memory_bytes, _child_labels(source, labels), FORK_ELSEWHERE)
            assert parent.runtime is not None  # a running sandbox (SandboxManager.using)
            try:
                point = await impl.fork_point(parent.runtime)
            except OSError as err:
                raise node_error(f"sandbox {sandbox_id} could not be forked", err) from err
            except CannotFork:
                raise
            except FailedPrecondition as err:
                raise _fork_failure(f"sandbox {sandbox_id} could not be forked", err) from err
        try:
            return await self._make_children(source, point, count, labels, lease_ttl_s)
        finally:
            await impl.drop_fork_point(point)

    async def _make_children(
        self, source: Sandbox, point: ForkPoint, count: int, labels: dict[str, str], lease_ttl_s: float
    ) -> list[Sandbox]:
        impl = self.sandboxes.backends[source.backend]
        child_labels = _child_labels(source, labels)
        # From here to the table entries below there is no await (as in create).
        self.sandboxes.admit(count, source.limits.memory_bytes, child_labels, FORK_ELSEWHERE, starting=True)
        children = [
            Sandbox(
                sandbox_id=new_sandbox_id(),
                backend=source.backend,
                image=source.image,
                limits=source.limits,
                network=source.network,
                env=dict(source.env),
                labels=dict(child_labels),
                idle_timeout_s=source.idle_timeout_s,
                user=source.user,
                owner=self._owner_of_children(source, child_labels),
                mounts=source.mounts,
                lease_ttl_s=lease_ttl_s,
            )
            for _ in range(count)
        ]
        self.sandboxes.reserve(children)  # (in the table before any await: admitted together)
        with self.sandboxes.gate.starting_slots(count):
            try:
                made = await asyncio.gather(
                    *(self.sandboxes.add(c, impl, point) for c in children), return_exceptions=True
                )
            except BaseException:
                # Cancelled (the caller's deadline passed, or it stopped waiting): the children
                # already up would have no owner, so they go as a failed fork's do. (The gather
                # finishes only once every add has, each one that was cut short undoing itself.)
                await asyncio.shield(asyncio.ensure_future(self._drop_children(children)))
                raise
        failed = [r for r in made if isinstance(r, BaseException)]
        if failed:
            await self._drop_children(children)
            if isinstance(failed[0], FailedPrecondition):
                raise _fork_failure("a child of the fork could not be started", failed[0]) from failed[0]
            raise failed[0]
        return children

    def _owner_of_children(self, source: Sandbox, labels: dict[str, str]) -> str:
        """Children are their source's owner's, whoever forks it (an admin's fork of a user's
        sandbox gives the user's children); the daemon's own fork for a rollout, its submitter's."""
        if current_caller().internal:
            return self.sandboxes.rollout_owner(labels) or source.owner
        return source.owner

    async def _drop_children(self, children: list[Sandbox]) -> None:
        """Destroys those of a fork's children that came up (all of them or none)."""
        up = [child for child in children if child.sandbox_id in self.sandboxes]
        for child, result in zip(
            up,
            await asyncio.gather(*(self.sandboxes.destroy(c.sandbox_id) for c in up), return_exceptions=True),
            strict=True,
        ):
            if isinstance(result, Exception) and not isinstance(result, NotFound):
                log.error("could not tear down sandbox %s of a failed fork: %s", child.sandbox_id, result)

    # -- named snapshots ---------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str) -> NamedSnapshot:
        """Keeps a copy of a running sandbox's writable filesystem under `name`, which ForkSandbox
        can make sandboxes from later, after the sandbox is gone too (until DeleteSnapshot or the
        daemon's restart). INVALID_ARGUMENT for a bad name, ALREADY_EXISTS for a taken one,
        RESOURCE_EXHAUSTED past the backend's store."""
        self.sandboxes.check_open()
        if not SNAPSHOT_NAME.fullmatch(name):
            raise InvalidArgument(
                f"a snapshot name is 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit, got {name!r}"
            )
        key = (self.sandboxes.get(sandbox_id).owner, name)  # (NOT_FOUND first for another's sandbox)
        if key in self._snapshots or key in self._snapshots_starting:
            raise AlreadyExists(f"a snapshot named {name!r} exists on this node")
        stored = self._storage_name(name)
        self._snapshots_starting.add(key)
        self._stored_names.add(stored)
        try:
            with self.sandboxes.using(sandbox_id) as sandbox:
                assert sandbox.runtime is not None  # a running sandbox (SandboxManager.using)
                impl = self.sandboxes.backends[sandbox.backend]
                try:
                    point, size = await impl.keep_snapshot(sandbox.runtime, stored)
                except OSError as err:
                    raise node_error(f"sandbox {sandbox_id} could not be snapshot", err) from err
                named = NamedSnapshot(name, _settings_of(sandbox), point, size, stored)
                self._snapshots[key] = named
                return named
        except BaseException:
            self._stored_names.discard(stored)
            raise
        finally:
            self._snapshots_starting.discard(key)

    def _storage_name(self, name: str) -> str:
        """What the backend keeps a new snapshot under: its name, unless another owner's snapshot
        is kept under it already (names are per owner, the backends' stores are the node's)."""
        return name if name not in self._stored_names else f"{name}.{secrets.token_hex(6)}"

    def snapshots(self) -> list[NamedSnapshot]:
        """The snapshots the current caller may see."""
        caller = current_caller()
        return [named for named in self._snapshots.values() if caller.may_act_on(named.source.owner)]

    def _find_snapshot(self, name: str) -> NamedSnapshot:
        """The current caller's snapshot `name`; for an admin, when it has none of that name,
        another owner's (NOT_FOUND when nobody it may see has one)."""
        caller = current_caller()
        named = self._snapshots.get((caller.owner, name))
        if named is None and caller.admin:
            named = next((s for s in self._snapshots.values() if s.name == name), None)
        if named is None:
            raise NotFound(f"no snapshot named {name!r} on this node")
        return named

    async def delete_snapshot(self, name: str) -> None:
        named = self._find_snapshot(name)
        del self._snapshots[named.key]
        self._stored_names.discard(named.stored_name)
        await self.sandboxes.backends[named.source.backend].drop_fork_point(named.point)


def _fork_failure(what: str, err: FailedPrecondition) -> Unavailable:
    """ForkSandbox answers FAILED_PRECONDITION only for a backend that cannot fork at all here
    (CannotFork, and a parent that is not running), which a caller may remember as such; any
    other refusal met on the way (a child the backend could not start, a parent the engine could
    not resume) failed this fork only: UNAVAILABLE, to be retried."""
    return Unavailable(f"{what}: {err}")


def _child_labels(source: Sandbox, labels: dict[str, str]) -> dict[str, str]:
    """A fork's children's labels: their source's, the request's, and the fork's generation and
    parent."""
    generation = int(source.labels.get(FORK_GENERATION_LABEL, "0") or 0) + 1
    return {
        **source.labels,
        **labels,
        FORK_GENERATION_LABEL: str(generation),
        FORK_PARENT_LABEL: source.sandbox_id,
    }


def _settings_of(sandbox: Sandbox) -> Sandbox:
    """A copy of a sandbox's entry with its settings and labels only, as forks take them (never in
    the table: no runtime, no state)."""
    return replace(
        sandbox,
        env=dict(sandbox.env),
        labels=dict(sandbox.labels),
        runtime=None,
        state="stopping",
        busy=0,
        created=asyncio.Event(),
        destroyed=asyncio.Event(),
    )
