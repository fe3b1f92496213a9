"""ForkManager: ForkSandbox, and the named snapshots that forks can start from (SnapshotSandbox,
ListSnapshots, DeleteSnapshot). Children are admitted and entered in the sandbox table as
creates are (SandboxManager.admit, reserve, add), all of them or none."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field, replace

from corral.sdk.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable

from . import rules
from .backends.base import CannotFork, ForkPoint
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
    """A sandbox's writable filesystem kept under a name (ForkManager.snapshot)."""

    name: str
    source: Sandbox  # a copy of its sandbox's entry as it was (settings and labels; no runtime)
    point: ForkPoint
    size_bytes: int
    created_at: float = field(default_factory=time.time)


class ForkManager:
    def __init__(self, config: Config, sandboxes: SandboxManager) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self._snapshots: dict[str, NamedSnapshot] = {}
        self._snapshots_starting: set[str] = set()

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
            named = self._snapshots.get(snapshot)
            if named is None:
                raise NotFound(f"no snapshot named {snapshot!r} on this node")
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
        if name in self._snapshots or name in self._snapshots_starting:
            raise AlreadyExists(f"a snapshot named {name!r} exists on this node")
        self._snapshots_starting.add(name)
        try:
            with self.sandboxes.using(sandbox_id) as sandbox:
                assert sandbox.runtime is not None  # a running sandbox (SandboxManager.using)
                impl = self.sandboxes.backends[sandbox.backend]
                try:
                    point, size = await impl.keep_snapshot(sandbox.runtime, name)
                except OSError as err:
                    raise node_error(f"sandbox {sandbox_id} could not be snapshot", err) from err
                named = NamedSnapshot(name, _settings_of(sandbox), point, size)
                self._snapshots[name] = named
                return named
        finally:
            self._snapshots_starting.discard(name)

    def snapshots(self) -> list[NamedSnapshot]:
        return list(self._snapshots.values())

    async def delete_snapshot(self, name: str) -> None:
        named = self._snapshots.pop(name, None)
        if named is None:
            raise NotFound(f"no snapshot named {name!r} on this node")
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
