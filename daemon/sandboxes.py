"""SandboxManager: the daemon's table of sandboxes and everything done to them.

Servicers translate protos into calls on this object; it owns ids, defaults, limits, leases,
idempotency keys, admission, draining, the reaper of idle sandboxes and expired leases, crash
recovery and the order of teardown.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TypeVar

from corral.sdk.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

from . import rules
from .admission import CreateGate, admit_memory, node_memory_bytes
from .backends.base import Backend, BindMount, CannotFork, ForkPoint, Limits, SandboxRuntime, SandboxSpec
from .commands import sandbox_environment
from .config import Config, ConfigError, PoolEntry
from .fsaccess import Entry, SandboxFiles
from .idempotency import IdempotentCreates
from .metrics import Metrics
from .mounts import MountRequest, bind_mounts
from .output import HeadTailBuffer
from .pools import PoolKey, WarmPools
from .process import ProcessExit
from .state import StateStore

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_SWEEP_S = 1.0
# Output a streamed command may have waiting for its client (ExecStream, Download): past this the
# daemon stops reading the command's pipes until the client catches up, so memory stays bounded
# whatever the command produces and however slowly the client reads.
STREAM_BUFFER_BYTES = 1 << 20
FILE_THREADS = 16
# ForkSandbox: children per call, and the labels every child gets (its generation counts forks
# from the first sandbox: 1 for a child, 2 for a child's child).
MAX_FORK_COUNT = 64
FORK_GENERATION_LABEL = "corral.fork.generation"
FORK_PARENT_LABEL = "corral.fork.parent"
# Why a drain refuses forks too (their parent or snapshot is on this node: no "elsewhere" to name).
FORK_ELSEWHERE = "forks included"
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class Sandbox:
    sandbox_id: str
    backend: str
    image: str
    limits: Limits
    network: bool
    env: dict[str, str]
    labels: dict[str, str]
    idle_timeout_s: float
    user: str = ""  # who its programs run as unless a call names another ("": the image's user)
    mounts: tuple[BindMount, ...] = ()
    # Its lease: the TTL last set (0: no lease) and when it expires (monotonic for the reaper,
    # Unix time for records and replies); set once the sandbox runs, and by each renewal.
    lease_ttl_s: float = 0.0
    lease_deadline: float = 0.0
    lease_expires_at: float = 0.0
    idempotency_key: str = ""
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    state: str = "starting"  # starting | running | failed | stopping
    runtime: SandboxRuntime | None = None
    busy: int = 0  # calls in flight; an idle sandbox is never reaped mid-call
    # Set when creation has finished (either way) and when teardown has: a destroy that arrives
    # mid-creation waits for the first, a second destroy for the second.
    created: asyncio.Event = field(default_factory=asyncio.Event)
    destroyed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class NamedSnapshot:
    """A sandbox's writable filesystem kept under a name (SandboxManager.snapshot)."""

    name: str
    source: Sandbox  # a copy of its sandbox's entry as it was (settings and labels; no runtime)
    point: ForkPoint
    size_bytes: int
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class _Request:
    """A CreateSandbox request as its caller gave it (defaults not filled in): what a retry with
    the same idempotency key must repeat."""

    backend: str
    image: str
    limits: Limits
    network: bool
    env: tuple[tuple[str, str], ...]  # sorted
    labels: tuple[tuple[str, str], ...]  # sorted
    idle_timeout_ms: int
    user: str
    mounts: tuple[MountRequest, ...]


@dataclass(frozen=True)
class ExecOutcome:
    exit: ProcessExit
    oom_killed: bool
    stdout: bytes
    stderr: bytes
    truncated: bool
    stdout_total: int
    stderr_total: int


@dataclass(frozen=True)
class Started:
    pid: int


@dataclass(frozen=True)
class Output:
    stream: int
    data: bytes


@dataclass(frozen=True)
class Keepalive:
    pass


@dataclass(frozen=True)
class Exited:
    outcome: ExecOutcome


class SandboxManager:
    def __init__(self, config: Config, backends: dict[str, Backend], state: StateStore, metrics: Metrics):
        self.config = config
        self.backends = backends
        self.state = state
        self.metrics = metrics
        self._sandboxes: dict[str, Sandbox] = {}
        self._closing = False
        self._reaper: asyncio.Task | None = None
        self._destroy_hooks: list[Callable[[str], Awaitable[None]]] = []
        self._files_pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="sandbox-files")
        self._snapshots: dict[str, NamedSnapshot] = {}
        self._snapshots_starting: set[str] = set()
        self.node_memory_bytes = node_memory_bytes()
        self.pools = WarmPools(config.pools, metrics, self._make_pooled, self._discard_pooled)
        admission = config.admission
        self.gate = CreateGate(admission.max_starting, admission.max_creates_per_s, admission.create_burst)
        self.idempotent: IdempotentCreates[Sandbox] = IdempotentCreates(
            config.leases.idempotency_window_s, lambda sb: self._sandboxes.get(sb.sandbox_id) is sb
        )
        # Draining (Drain): no new sandboxes. `own_rollout(labels)` says whether a create is for
        # a rollout this daemon runs: those pass the drain (a rollout accepted before it
        # finishes) and the pace caps of [admission] (rollout.init_workers bounds them already).
        # A drain outlives a restart (the state directory's marker): a node taken out of service
        # stays out until it is undone.
        self.draining = state.draining
        self.own_rollout: Callable[[dict[str, str]], bool] = lambda labels: False

    def on_destroy(self, hook: Callable[[str], Awaitable[None]]) -> None:
        """Registers `await hook(sandbox_id)`, run before a sandbox is torn down (shells and
        kernels close their sessions there)."""
        self._destroy_hooks.append(hook)

    # -- lifecycle of the manager -------------------------------------------------------------------

    async def start(self) -> None:
        await self.recover()
        for entry in self.config.pool:
            self.pools.add(entry.name, self._pool_key(entry), entry.size)
        if self.draining:
            log.warning("the node is draining (since before this start): no new sandboxes until `corral drain --undo`")
            await self.pools.pause()
        self.pools.start()
        self._reaper = asyncio.create_task(self._reap())

    async def recover(self) -> None:
        """Removes whatever a previous daemon run left behind (after kill -9 or a power cut). A
        daemon does not take over the sandboxes of an earlier run, so a leased sandbox ends here
        too, however much of its lease was left (a lease never outlives its daemon)."""
        for sandbox_id, record in self.state.records():
            try:
                backend = self.backends.get(str(record.get("backend", "")))
                if backend:
                    await backend.reap(record)
                lease = record.get(LEASE_RECORD_KEY)
                log.info("reaped leftover sandbox %s%s", sandbox_id, f" (lease until {lease} ms)" if lease else "")
            except Exception:
                log.exception("could not reap leftover sandbox %s", sandbox_id)
            self.state.remove(sandbox_id)
        for backend in self.backends.values():
            await backend.reap_orphans()

    async def close(self) -> None:
        """Destroys every sandbox; new work is refused from now on."""
        self._closing = True
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.pools.close()
        await asyncio.gather(*(self.destroy(sid) for sid in list(self._sandboxes)), return_exceptions=True)
        self._files_pool.shutdown(wait=False, cancel_futures=True)

    async def _reap(self) -> None:
        """Destroys sandboxes whose lease expired (calls in flight or not: only RenewLease keeps a
        lease) and those idle past their idle timeout."""
        while True:
            await asyncio.sleep(IDLE_SWEEP_S)
            now = time.monotonic()
            for sb in list(self._sandboxes.values()):
                if sb.lease_deadline and now >= sb.lease_deadline and sb.state in ("running", "failed"):
                    log.info("destroying sandbox %s: its lease expired", sb.sandbox_id)
                    self.metrics.leases_expired.inc()
                elif sb.idle_timeout_s and not sb.busy and now - sb.last_used > sb.idle_timeout_s:
                    log.info("destroying idle sandbox %s", sb.sandbox_id)
                else:
                    continue
                with contextlib.suppress(NotFound):
                    await self.destroy(sb.sandbox_id)

    # -- sandboxes ---------------------------------------------------------------------------------

    async def create(
        self,
        *,
        backend: str,
        image: str,
        limits: Limits,
        network: bool,
        env: dict[str, str],
        labels: dict[str, str],
        idle_timeout_ms: int,
        user: str = "",
        mounts: builtins.list[MountRequest] | tuple[MountRequest, ...] = (),
        lease_ttl_ms: int = 0,
        idempotency_key: str = "",
    ) -> Sandbox:
        """A running sandbox, or an error and nothing left behind: no backend sandbox, no record,
        no table entry (so no slot of max_sandboxes taken, and no Destroy or shutdown waiting on
        a creation that will never finish). `user` and `mounts` are checked here (rules.user,
        mounts.bind_mounts) and reach the backend in its SandboxSpec. With an idempotency key,
        a create that repeats an earlier one returns its sandbox (daemon/idempotency.py)."""
        if self._closing:
            raise Unavailable("the daemon is shutting down")
        lease_ttl_s = rules.lease_ttl_s(self.config.leases, lease_ttl_ms)
        request = _Request(
            backend, image, limits, network, _env_key(env), _env_key(labels), idle_timeout_ms, user, tuple(mounts)
        )
        if not idempotency_key:
            return await self._create(request, lease_ttl_s, "")
        # A retry must repeat the request, its lease included (the key itself aside).
        sandbox, hit = await self.idempotent.create(
            idempotency_key, (request, lease_ttl_ms), lambda: self._create(request, lease_ttl_s, idempotency_key)
        )
        if hit:
            self.metrics.idempotent_hits.inc()
        return sandbox

    async def _create(self, request: _Request, lease_ttl_s: float, idempotency_key: str) -> Sandbox:
        backend, image, limits, network, user, mounts = (
            request.backend,
            request.image,
            request.limits,
            request.network,
            request.user,
            request.mounts,
        )
        labels = dict(request.labels)
        paced = self._pass_drain(labels, "create the sandbox on another node")
        backend = backend or self.config.daemon.default_backend
        impl = self.backends.get(backend)
        if impl is None:
            raise FailedPrecondition(f"backend {backend!r} is not configured on this node")
        env = rules.environment(dict(request.env))
        limits = rules.sandbox_limits(limits, self.config.limits)
        idle_timeout_s = rules.sandbox_idle_timeout_s(self.config.limits, request.idle_timeout_ms)
        user = rules.user(user)
        # (In a thread: resolving host paths may wait on a slow filesystem. Before the capacity
        # check below, which must not be separated from taking the slot by an await.)
        checked_mounts: tuple[BindMount, ...] = ()
        if mounts:
            checked_mounts = await asyncio.to_thread(
                bind_mounts,
                mounts,
                roots=self.config.sandbox.bind_roots,
                protected=(*impl.context.hidden_paths, str(impl.context.run_base)),
                workdir=impl.context.workdir,
            )
            if self._closing:
                raise Unavailable("the daemon is shutting down")
        image = image or _default_image(impl)
        # From the admission checks to the table entry below there is no await: sandboxes still
        # starting count, so concurrent creations cannot both take the last of the capacity.
        self._admit(1, limits.memory_bytes, paced=paced)
        if not checked_mounts:  # a pool prepares no bind mounts
            pooled = self.pools.take(PoolKey(backend, image, limits, network, _env_key(env), user))
            if pooled is not None:
                if paced:
                    self.gate.take()  # a pool hit counts against the rate, not as a start
                pooled.idempotency_key = idempotency_key
                return self._hand_out(pooled, labels, idle_timeout_s, lease_ttl_s)
        self._admit_starts(1, paced=paced)
        sandbox = Sandbox(
            sandbox_id=_new_sandbox_id(),
            backend=backend,
            image=image,
            limits=limits,
            network=network,
            env=dict(env),
            labels=dict(labels),
            idle_timeout_s=idle_timeout_s,
            user=user,
            mounts=checked_mounts,
            lease_ttl_s=lease_ttl_s,
            idempotency_key=idempotency_key,
        )
        with self.gate.starting_slots():
            return await self._add(sandbox, impl)

    async def _add(self, sandbox: Sandbox, impl: Backend, fork: ForkPoint | None = None) -> Sandbox:
        """Brings an admitted sandbox up in the table (see create; its caller holds its start
        slot, CreateGate.starting_slots)."""
        self._sandboxes[sandbox.sandbox_id] = sandbox
        try:
            await self._bring_up(sandbox, impl, fork)
        except BaseException:
            sandbox.state = "failed"
            self._sandboxes.pop(sandbox.sandbox_id, None)
            self.state.remove(sandbox.sandbox_id)
            raise
        finally:
            sandbox.created.set()
            if sandbox.state == "failed":
                sandbox.destroyed.set()
        sandbox.state = "running"
        self.metrics.sandboxes_live.set(len(self._sandboxes))
        self.metrics.sandboxes_created.labels(sandbox.backend).inc()
        return sandbox

    def _pass_drain(self, labels: dict[str, str], elsewhere: str) -> bool:
        """Raises UNAVAILABLE while the node drains, unless sandboxes with these labels are for a
        rollout this daemon runs; returns whether the pace caps of [admission] apply to them
        (they do not to the daemon's own rollouts, which rollout.init_workers bounds already)."""
        own_rollout = self.own_rollout(labels)
        if self.draining and not own_rollout:
            self.metrics.admission_refusals.labels("draining").inc()
            raise Unavailable(f"this node is draining: it takes no new sandboxes ({elsewhere})")
        return not own_rollout

    def _admit(self, count: int, memory_bytes: int, *, paced: bool) -> None:
        """The checks of `count` new sandboxes of `memory_bytes` each against the node: the rate
        of creates (when `paced`; `count` tokens), its sandbox count and its memory, each refusal
        counted by reason. Takes nothing. Sandboxes still starting count (they enter the table
        with no await between these checks and that), so two concurrent creations cannot both
        take the last of the capacity."""
        if paced:
            self._refusing("rate", lambda: self.gate.check_rate(count))
        slots = self.config.daemon.max_sandboxes
        if len(self._sandboxes) + count > slots:
            self.metrics.admission_refusals.labels("slots").inc()
            raise ResourceExhausted(
                f"this node already runs {len(self._sandboxes)} sandboxes, and {count} more would exceed "
                f"{slots} (daemon.max_sandboxes)"
                if count > 1
                else f"this node already runs {slots} sandboxes (daemon.max_sandboxes)"
            )
        self._refusing("memory", lambda: self._admit_memory(count, memory_bytes))

    def _admit_memory(self, count: int, memory_bytes: int) -> None:
        held = [sb.limits.memory_bytes for sb in self._sandboxes.values()]
        for _ in range(count):
            admit_memory(held, memory_bytes, self.node_memory_bytes, self.config.daemon.memory_overcommit)
            held.append(memory_bytes)

    def _admit_starts(self, count: int, *, paced: bool) -> None:
        """The last check of `count` admitted sandboxes about to start (when `paced`): the starts
        under way (admission.max_starting); then spends their `count` tokens of the rate. The
        caller then holds `count` start slots while they are made (CreateGate.starting_slots)."""
        if paced:
            self._refusing("starting", lambda: self.gate.check_start(count))
            self.gate.take(count)

    def _refusing(self, reason: str, check: Callable[[], None]) -> None:
        try:
            check()
        except ResourceExhausted:
            self.metrics.admission_refusals.labels(reason).inc()
            raise

    def _hand_out(self, sandbox: Sandbox, labels: dict[str, str], idle_timeout_s: float, lease_ttl_s: float) -> Sandbox:
        """A pooled sandbox as the caller's: what the request sets beyond its shape, and the
        created time a fresh one would have."""
        sandbox.labels = dict(labels)
        sandbox.idle_timeout_s = idle_timeout_s
        sandbox.created_at = time.time()
        sandbox.last_used = time.monotonic()
        if lease_ttl_s:
            self._lease(sandbox, lease_ttl_s)
            self._save_record(sandbox)
        self._sandboxes[sandbox.sandbox_id] = sandbox
        self.metrics.sandboxes_live.set(len(self._sandboxes))
        self.metrics.sandboxes_created.labels(sandbox.backend).inc()
        return sandbox

    def _pool_key(self, entry: PoolEntry) -> PoolKey:
        """The shape of a [[pool]] entry, with the node's defaults filled in as a request's are."""
        backend = entry.backend or self.config.daemon.default_backend
        impl = self.backends.get(backend)
        if impl is None:
            raise ConfigError(f"pool {entry.name}: backend {backend!r} is not configured on this node")
        try:
            limits = Limits(entry.memory_bytes, entry.pids, entry.cpu_millicores, entry.disk_bytes)
            return PoolKey(
                backend,
                entry.image or _default_image(impl),
                rules.sandbox_limits(limits, self.config.limits),
                entry.network,
                _env_key(rules.environment(entry.env)),
                rules.user(entry.user),
            )
        except InvalidArgument as err:
            raise ConfigError(f"pool {entry.name}: {err}") from None

    async def _make_pooled(self, key: PoolKey) -> Sandbox:
        """A running sandbox of this shape, made as create makes one but not in the table (so
        neither listed nor reaped for idleness); its state record is saved as any sandbox's."""
        sandbox = Sandbox(
            sandbox_id=_new_sandbox_id(),
            backend=key.backend,
            image=key.image,
            limits=key.limits,
            network=key.network,
            env=dict(key.env),
            labels={},
            idle_timeout_s=0.0,
            user=key.user,
        )
        try:
            await self._bring_up(sandbox, self.backends[key.backend])
        except BaseException:
            sandbox.state = "failed"
            self.state.remove(sandbox.sandbox_id)
            sandbox.destroyed.set()
            raise
        finally:
            sandbox.created.set()
        sandbox.state = "running"
        return sandbox

    async def _discard_pooled(self, sandbox: Sandbox) -> None:
        """Tears down a pooled sandbox never handed out (nothing ran in it: no destroy hooks)."""
        sandbox.state = "stopping"
        try:
            if sandbox.runtime:
                await sandbox.runtime.destroy()
        except Exception:
            log.exception("could not tear down pooled sandbox %s", sandbox.sandbox_id)
        finally:
            self.state.remove(sandbox.sandbox_id)
            sandbox.destroyed.set()

    async def fork(
        self, sandbox_id: str, count: int, labels: dict[str, str], snapshot: str = "", lease_ttl_ms: int = 0
    ) -> builtins.list[Sandbox]:
        """`count` new sandboxes whose writable filesystem starts as a copy-on-write copy of the
        parent's at this moment (or of a named snapshot's, see `snapshot`), with its image,
        limits, network, env, user, mounts and labels (plus `labels` and the fork's generation and
        parent); its processes are not copied. All of them or none: a fork that fails, or is
        cancelled (its caller's deadline passed), leaves no child and no fork point behind.

        A fork is `count` creates to admission: refused while the node drains (UNAVAILABLE), and
        `count` sandboxes against daemon.max_sandboxes, the memory and the pace caps of
        [admission] (CreateGate). Children have a lease of `lease_ttl_ms` (0: none; never the
        parent's, which a fork does not take over) and no idempotency key."""
        if self._closing:
            raise Unavailable("the daemon is shutting down")
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
        with self.using(sandbox_id) as parent:
            source = _settings_of(parent)
            impl = self.backends[source.backend]
            # Refused before the fork point is made (the parent pauses for it), and checked again
            # once it is (_make_children).
            paced = self._pass_drain(_child_labels(source, labels), FORK_ELSEWHERE)
            self._admit(count, source.limits.memory_bytes, paced=paced)
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
    ) -> builtins.list[Sandbox]:
        impl = self.backends[source.backend]
        child_labels = _child_labels(source, labels)
        # From here to the table entries below there is no await (as in create).
        paced = self._pass_drain(child_labels, FORK_ELSEWHERE)
        self._admit(count, source.limits.memory_bytes, paced=paced)
        self._admit_starts(count, paced=paced)
        children = [
            Sandbox(
                sandbox_id=_new_sandbox_id(),
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
        for child in children:  # (in the table before any await: admitted together)
            self._sandboxes[child.sandbox_id] = child
        with self.gate.starting_slots(count):
            try:
                made = await asyncio.gather(*(self._add(c, impl, point) for c in children), return_exceptions=True)
            except BaseException:
                # Cancelled (the caller's deadline passed, or it stopped waiting): the children
                # already up would have no owner, so they go as a failed fork's do. (The gather
                # finishes only once every _add has, each one that was cut short undoing itself.)
                await asyncio.shield(asyncio.ensure_future(self._drop_children(children)))
                raise
        failed = [r for r in made if isinstance(r, BaseException)]
        if failed:
            await self._drop_children(children)
            if isinstance(failed[0], FailedPrecondition):
                raise _fork_failure("a child of the fork could not be started", failed[0]) from failed[0]
            raise failed[0]
        return children

    async def _drop_children(self, children: builtins.list[Sandbox]) -> None:
        """Destroys those of a fork's children that came up (all of them or none)."""
        up = [child for child in children if child.sandbox_id in self._sandboxes]
        for child, result in zip(
            up, await asyncio.gather(*(self.destroy(c.sandbox_id) for c in up), return_exceptions=True), strict=True
        ):
            if isinstance(result, Exception) and not isinstance(result, NotFound):
                log.error("could not tear down sandbox %s of a failed fork: %s", child.sandbox_id, result)

    # -- named snapshots ---------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str) -> NamedSnapshot:
        """Keeps a copy of a running sandbox's writable filesystem under `name`, which ForkSandbox
        can make sandboxes from later, after the sandbox is gone too (until DeleteSnapshot or the
        daemon's restart). INVALID_ARGUMENT for a bad name, ALREADY_EXISTS for a taken one,
        RESOURCE_EXHAUSTED past the backend's store."""
        if self._closing:
            raise Unavailable("the daemon is shutting down")
        if not SNAPSHOT_NAME.fullmatch(name):
            raise InvalidArgument(
                f"a snapshot name is 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit, got {name!r}"
            )
        if name in self._snapshots or name in self._snapshots_starting:
            raise AlreadyExists(f"a snapshot named {name!r} exists on this node")
        self._snapshots_starting.add(name)
        try:
            with self.using(sandbox_id) as sandbox:
                assert sandbox.runtime is not None  # a running sandbox (SandboxManager.using)
                impl = self.backends[sandbox.backend]
                try:
                    point, size = await impl.keep_snapshot(sandbox.runtime, name)
                except OSError as err:
                    raise node_error(f"sandbox {sandbox_id} could not be snapshot", err) from err
                named = NamedSnapshot(name, _settings_of(sandbox), point, size)
                self._snapshots[name] = named
                return named
        finally:
            self._snapshots_starting.discard(name)

    def snapshots(self) -> builtins.list[NamedSnapshot]:
        return list(self._snapshots.values())

    async def delete_snapshot(self, name: str) -> None:
        named = self._snapshots.pop(name, None)
        if named is None:
            raise NotFound(f"no snapshot named {name!r} on this node")
        await self.backends[named.source.backend].drop_fork_point(named.point)

    async def _bring_up(self, sandbox: Sandbox, impl: Backend, fork: ForkPoint | None = None) -> None:
        """Saves the placeholder record, creates the backend's sandbox and saves its record; when
        a step fails, undoes the ones before it and raises a definite error (an OS error of the
        node, such as a full disk or no file descriptors left, as RESOURCE_EXHAUSTED or
        UNAVAILABLE)."""
        sid = sandbox.sandbox_id
        try:
            self.state.save(sid, impl.placeholder_record(sid))
            spec = SandboxSpec(
                sid, sandbox.image, sandbox.limits, sandbox.network, sandbox.env, sandbox.user, sandbox.mounts, fork
            )
            runtime = await impl.create(spec)
        except OSError as err:
            raise node_error(f"sandbox {sid} could not be created", err) from err
        if sandbox.lease_ttl_s:  # (a lease runs from when its sandbox is up)
            self._lease(sandbox, sandbox.lease_ttl_s)
        try:
            self.state.save(sid, _record(sandbox, runtime))
        except BaseException as err:
            try:
                await runtime.destroy()
            except Exception:
                log.exception("could not tear down sandbox %s after its record failed", sid)
            if isinstance(err, OSError):
                raise node_error(f"sandbox {sid} could not be created: its state record", err) from err
            raise
        sandbox.runtime = runtime

    def _lease(self, sandbox: Sandbox, ttl_s: float) -> None:
        sandbox.lease_ttl_s = ttl_s
        sandbox.lease_deadline = time.monotonic() + ttl_s
        sandbox.lease_expires_at = time.time() + ttl_s

    def _save_record(self, sandbox: Sandbox) -> None:
        """Saves a running sandbox's record again (its lease changed). A failed save is logged:
        the lease holds in this daemon all the same, and its record still names what to reap."""
        if sandbox.runtime is None:
            return
        try:
            self.state.save(sandbox.sandbox_id, _record(sandbox, sandbox.runtime))
        except OSError as err:
            log.warning("cannot save the lease of sandbox %s in its record: %s", sandbox.sandbox_id, err)

    def renew_lease(self, sandbox_id: str, ttl_ms: int) -> Sandbox:
        """Sets a sandbox's lease to expire `ttl_ms` from now; a sandbox without a lease gets one.
        A sandbox still starting gets its lease from when it is up."""
        ttl_s = rules.lease_ttl_s(self.config.leases, ttl_ms, "ttl_ms", required=True)
        sandbox = self.get(sandbox_id)
        if sandbox.state == "stopping":
            raise FailedPrecondition(f"sandbox {sandbox_id} is being destroyed")
        if sandbox.runtime is None:
            sandbox.lease_ttl_s = ttl_s
            return sandbox
        self._lease(sandbox, ttl_s)
        self._save_record(sandbox)
        return sandbox

    async def set_draining(self, draining: bool) -> None:
        """Drains the node (no new sandboxes, warm pools emptied and not refilled) or takes it
        back into service."""
        self.state.set_draining(draining)
        self.draining = draining
        if draining:
            await self.pools.pause()
        else:
            self.pools.resume()

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on this node")
        sandbox.last_used = time.monotonic()
        if sandbox.state == "running" and sandbox.runtime and not sandbox.runtime.alive():
            sandbox.state = "failed"
        return sandbox

    def list(self, labels: dict[str, str] | None = None) -> list[Sandbox]:
        wanted = (labels or {}).items()
        return [sb for sb in self._sandboxes.values() if wanted <= sb.labels.items()]

    def __len__(self) -> int:
        return len(self._sandboxes)

    async def destroy(self, sandbox_id: str) -> None:
        sandbox = self.get(sandbox_id)
        if not sandbox.created.is_set():
            await sandbox.created.wait()  # never leave a half-made sandbox running unlisted
        if sandbox.state == "stopping" or sandbox.destroyed.is_set():
            await sandbox.destroyed.wait()  # one teardown at a time; the second caller waits
            return
        sandbox.state = "stopping"
        try:
            for hook in self._destroy_hooks:
                try:
                    await hook(sandbox_id)
                except Exception:
                    log.exception("destroy hook failed for %s", sandbox_id)
            if sandbox.runtime:
                await sandbox.runtime.destroy()
        finally:
            self._sandboxes.pop(sandbox_id, None)
            self.state.remove(sandbox_id)
            self.metrics.sandboxes_live.set(len(self._sandboxes))
            sandbox.destroyed.set()

    @contextlib.contextmanager
    def using(self, sandbox_id: str):
        """The running sandbox for one call; keeps the idle reaper away while the call runs."""
        sandbox = self.get(sandbox_id)
        if sandbox.state != "running" or sandbox.runtime is None:
            raise FailedPrecondition(f"sandbox {sandbox_id} is {sandbox.state}, not running")
        sandbox.busy += 1
        try:
            yield sandbox
        finally:
            sandbox.busy -= 1
            sandbox.last_used = time.monotonic()

    # -- commands ----------------------------------------------------------------------------------

    def _start(self, sandbox: Sandbox, spec: rules.CommandSpec):
        runtime = sandbox.runtime
        assert runtime is not None  # a running sandbox (SandboxManager.using)
        argv = spec.argv if spec.argv is not None else runtime.shell_argv(spec.shell or "")
        env = sandbox_environment(runtime.home(spec.user), sandbox.env, spec.env)
        self.metrics.execs.labels(sandbox.backend).inc()
        return runtime.start_process(argv, env=env, cwd=spec.cwd, stdin=spec.stdin, user=spec.user)

    def _outcome(self, sandbox, proc, exit: ProcessExit, oom_before: int, out, err, truncated) -> ExecOutcome:
        oom = proc.cgroup is not None and proc.oom_kills() + _sandbox_ooms(sandbox) > oom_before
        if exit.timed_out:
            self.metrics.exec_timeouts.labels(sandbox.backend).inc()
        return ExecOutcome(exit, oom, out[0], err[0], truncated, out[1], err[1])

    async def exec(self, sandbox_id: str, request: rules.CommandRequest) -> ExecOutcome:
        """Runs a caller's command to completion (the request rules apply)."""
        return await self.run_command(sandbox_id, rules.command(self.config.exec, request))

    def exec_stream(
        self, sandbox_id: str, request: rules.CommandRequest, keepalive_ms: int
    ) -> AsyncGenerator[Started | Output | Keepalive | Exited, None]:
        """Streams a caller's command (the request rules apply); see stream_command."""
        spec = rules.command(self.config.exec, request)
        return self.stream_command(sandbox_id, spec, rules.keepalive_s(keepalive_ms))

    async def _in_directory(self, sandbox: Sandbox, spec: rules.CommandSpec) -> rules.CommandSpec:
        """`spec` with its cwd resolved inside the sandbox (relative to the workdir, as the file
        calls do): FAILED_PRECONDITION naming the path when it is missing or not a directory,
        instead of a command that fails to start."""
        runtime = sandbox.runtime
        assert runtime is not None  # a running sandbox (SandboxManager.using)
        if not spec.cwd or spec.cwd == runtime.workdir:
            return spec
        files = runtime.file_access()
        try:
            path, kind = await asyncio.get_running_loop().run_in_executor(self._files_pool, files.kind, spec.cwd)
        except NotFound as err:
            raise FailedPrecondition(
                f"cwd {files.absolute(spec.cwd)} does not exist in sandbox {sandbox.sandbox_id}"
            ) from err
        if kind != "directory":
            raise FailedPrecondition(f"cwd {path} is not a directory in sandbox {sandbox.sandbox_id} (it is a {kind})")
        return replace(spec, cwd=path)

    async def run_command(self, sandbox_id: str, spec: rules.CommandSpec) -> ExecOutcome:
        """Runs a checked command to completion (the daemon's own commands come here directly)."""
        with self.using(sandbox_id) as sandbox:
            spec = await self._in_directory(sandbox, spec)
            buffers = {1: HeadTailBuffer(spec.output_limit), 2: HeadTailBuffer(spec.output_limit)}
            oom_before = _sandbox_ooms(sandbox)
            proc = self._start(sandbox, spec)
            exit = await proc.run(lambda stream, data: buffers[stream].write(data), spec.timeout_s)
            out, err = buffers[1], buffers[2]
            return self._outcome(
                sandbox,
                proc,
                exit,
                oom_before,
                (out.getvalue(), out.total),
                (err.getvalue(), err.total),
                out.truncated or err.truncated,
            )

    async def stream_command(
        self, sandbox_id: str, spec: rules.CommandSpec, keepalive_s: float
    ) -> AsyncGenerator[Started | Output | Keepalive | Exited, None]:
        """Yields one Started, then Output/Keepalive events, then one Exited. Closing the iterator
        early (the client went away) kills the command's tree."""
        with self.using(sandbox_id) as sandbox:
            spec = await self._in_directory(sandbox, spec)
            queue: asyncio.Queue = asyncio.Queue()
            totals = {1: 0, 2: 0}
            queued = 0  # bytes in `queue`: past STREAM_BUFFER_BYTES the command's pipes are not read

            def forward(stream: int, data: bytes) -> None:
                nonlocal queued
                room = spec.output_limit - (totals[1] + totals[2])
                totals[stream] += len(data)
                if room > 0:
                    queue.put_nowait(Output(stream, data[:room]))
                    queued += min(room, len(data))
                    if queued >= STREAM_BUFFER_BYTES:
                        proc.pause_output()

            oom_before = _sandbox_ooms(sandbox)
            proc = self._start(sandbox, spec)
            # Running before Started is yielded: a client gone at that first event still has its
            # command killed, reaped and its leaf handed back (by cancelling the runner below).
            runner = asyncio.ensure_future(proc.run(forward, spec.timeout_s))
            getter: asyncio.Future | None = None
            try:
                await asyncio.sleep(0)  # the runner's first step: from here a cancel reaches run()
                yield Started(proc.pid)
                while True:
                    getter = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait(
                        {getter, runner}, timeout=keepalive_s or None, return_when=asyncio.FIRST_COMPLETED
                    )
                    if getter in done:
                        event = getter.result()
                        queued -= len(event.data)
                        if queued < STREAM_BUFFER_BYTES:
                            proc.resume_output()
                        # The next event is read only once the client took this one (gRPC waits
                        # for its flow-control window), so a slow client slows the command down.
                        yield event
                        continue
                    getter.cancel()
                    if runner in done:
                        break
                    yield Keepalive()
                while not queue.empty():
                    yield queue.get_nowait()
                exit = runner.result()
                truncated = totals[1] + totals[2] > spec.output_limit
                yield Exited(
                    self._outcome(sandbox, proc, exit, oom_before, (b"", totals[1]), (b"", totals[2]), truncated)
                )
            finally:
                if getter is not None and not getter.done():
                    getter.cancel()
                if not runner.done():
                    runner.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await runner

    # -- files -------------------------------------------------------------------------------------

    async def _files(self, sandbox_id: str, call: Callable[[SandboxFiles], T]) -> T:
        """Runs one blocking file operation in the file-operation pool: a pool of its own, so that
        slow file calls can never starve the daemon's other blocking work (cgroup kills, teardown)
        of threads."""
        with self.using(sandbox_id) as sandbox:
            assert sandbox.runtime is not None
            files = sandbox.runtime.file_access()
            return await asyncio.get_running_loop().run_in_executor(self._files_pool, call, files)

    async def read_file(self, sandbox_id: str, path: str, offset: int, limit: int) -> tuple[bytes, int, bool]:
        """(data, file size, truncated) of up to `limit` bytes (0: the cap) from `offset`."""
        return await self._files(sandbox_id, lambda files: files.read(path, offset, limit))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int, make_parents: bool) -> int:
        """Writes a whole file; returns the bytes written."""
        return await self._files(sandbox_id, lambda files: files.write(path, data, mode, make_parents))

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[Entry]:
        return await self._files(sandbox_id, lambda files: files.list(path))

    async def path_kind(self, sandbox_id: str, path: str) -> tuple[str, str]:
        """(absolute path, kind) of an existing path; NotFound otherwise."""
        return await self._files(sandbox_id, lambda files: files.kind(path))

    async def make_dirs(self, sandbox_id: str, path: str) -> str:
        """Creates a directory and its parents as the sandbox user; returns its absolute path."""
        return await self._files(sandbox_id, lambda files: files.make_dirs(path))

    async def make_staging_dir(self, sandbox_id: str, path: str) -> None:
        """Makes the hidden directory an upload is unpacked into (see SandboxFiles)."""
        await self._files(sandbox_id, lambda files: files.make_staging_dir(path))

    async def move_into(self, sandbox_id: str, staging: str, directory: str) -> None:
        """Moves what a staging directory holds into `directory`, merging directories."""
        await self._files(sandbox_id, lambda files: files.move_into(staging, directory))

    async def remove_tree(self, sandbox_id: str, path: str) -> None:
        await self._files(sandbox_id, lambda files: files.remove_tree(path))


def _fork_failure(what: str, err: FailedPrecondition) -> Unavailable:
    """ForkSandbox answers FAILED_PRECONDITION only for a backend that cannot fork at all here
    (CannotFork, and a parent that is not running), which a caller may remember as such; any
    other refusal met on the way (a child the backend could not start, a parent the engine could
    not resume) failed this fork only: UNAVAILABLE, to be retried."""
    return Unavailable(f"{what}: {err}")


def node_error(what: str, err: OSError) -> ResourceExhausted | Unavailable:
    """An OS error of the node itself (not of the request) as the caller should see it: a
    resource the node has run out of is RESOURCE_EXHAUSTED, anything else UNAVAILABLE; both say
    to retry later or elsewhere."""
    reason = f"{what}: {err.strerror or err}"
    if err.errno in NODE_EXHAUSTED:
        return ResourceExhausted(reason)
    return Unavailable(reason)


NODE_EXHAUSTED = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOBUFS}
)


def _new_sandbox_id() -> str:
    return f"sb-{secrets.token_hex(6)}"


# The key of a sandbox record that holds its lease's expiry (ms since the Unix epoch).
LEASE_RECORD_KEY = "lease_expires_at_unix_ms"


def _record(sandbox: Sandbox, runtime: SandboxRuntime) -> dict:
    """A sandbox's state record: its backend's, with its lease when it has one."""
    record = runtime.record()
    if sandbox.lease_expires_at:
        record = {**record, LEASE_RECORD_KEY: int(sandbox.lease_expires_at * 1000)}
    return record


def _env_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(env.items()))


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


def _default_image(backend: Backend) -> str:
    default = backend.default_image()
    if not default:
        raise InvalidArgument(f"the {backend.name} backend needs an image (this node configures no default)")
    return default


def _sandbox_ooms(sandbox: Sandbox) -> int:
    cgroup = getattr(sandbox.runtime, "cgroup", None)
    return cgroup.oom_kills() if cgroup else 0
