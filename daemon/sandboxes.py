"""SandboxManager: the daemon's table of sandboxes.

It owns ids, defaults, limits, leases, idempotency keys, admission, draining, warm pools, the
reaper of idle sandboxes and expired leases, crash recovery and the order of teardown. What is
done in a sandbox has managers of its own beside it, each taking a running sandbox from the table
for one call (`using`): commands (execs.py), files (files.py), forks and snapshots (forks.py),
shells (shells.py), background processes (processes.py) and kernels (kernels.py). Servicers
translate protos into calls on these objects.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable

from . import rules
from .admission import CreateGate, admit_memory, node_memory_bytes
from .backends.base import Backend, BindMount, ForkPoint, Limits, SandboxRuntime, SandboxSpec
from .callers import current_caller
from .cgroups import LimitSupport
from .config import Config, ConfigError, PoolEntry
from .idempotency import IdempotentCreates
from .metrics import Metrics
from .mounts import MountRequest, bind_mounts
from .pools import PoolKey, WarmPools
from .state import StateStore

log = logging.getLogger(__name__)

IDLE_SWEEP_S = 1.0


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
    # Who made it (callers.py): only that caller and admins see it. "": nobody's yet (a warm
    # pool's sandbox until a create takes it).
    owner: str = ""
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

    def limit_support(self) -> dict[str, LimitSupport]:
        """Which of its limits hold, by kind: its backend's, less the network isolation it was
        created without and the disk cap the node does not set."""
        limits = dict(self.runtime.limits) if self.runtime else {}
        if "network" in limits and self.network:
            limits["network"] = LimitSupport(False, reason="the sandbox was created with network access")
        if "disk" in limits and not self.limits.disk_bytes:
            limits["disk"] = LimitSupport(False, reason="no cap: limits.disk_bytes is 0 on this node")
        return limits


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
        # `rollout_owner(labels)`: who submitted the live rollout these labels name (None: none),
        # whose sandbox the daemon's own create then makes (callers.py).
        self.rollout_owner: Callable[[dict[str, str]], str | None] = lambda labels: None

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

    def check_open(self) -> None:
        """UNAVAILABLE once the daemon is shutting down (close): no new sandboxes from then on."""
        if self._closing:
            raise Unavailable("the daemon is shutting down")

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
        self.check_open()
        lease_ttl_s = rules.lease_ttl_s(self.config.leases, lease_ttl_ms)
        owner = self.owner_of_new(labels)
        request = _Request(
            backend, image, limits, network, _env_key(env), _env_key(labels), idle_timeout_ms, user, tuple(mounts)
        )
        if not idempotency_key:
            return await self._create(request, lease_ttl_s, "", owner)
        # A retry must repeat the request, its lease included (the key itself aside).
        sandbox, hit = await self.idempotent.create(
            idempotency_key,
            (request, lease_ttl_ms),
            lambda: self._create(request, lease_ttl_s, idempotency_key, owner),
            owner=owner,
        )
        if hit:
            self.metrics.idempotent_hits.inc()
        return sandbox

    def owner_of_new(self, labels: dict[str, str]) -> str:
        """Who a sandbox made now for the current caller belongs to: the caller; for the daemon's
        own create (its rollout service), the submitter of the rollout its labels name."""
        caller = current_caller()
        if caller.internal:
            return self.rollout_owner(labels) or caller.owner
        return caller.owner

    async def _create(self, request: _Request, lease_ttl_s: float, idempotency_key: str, owner: str) -> Sandbox:
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
            self.check_open()
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
                pooled.owner = owner
                return self._hand_out(pooled, labels, idle_timeout_s, lease_ttl_s)
        self._admit_starts(1, paced=paced)
        sandbox = Sandbox(
            sandbox_id=new_sandbox_id(),
            backend=backend,
            image=image,
            limits=limits,
            network=network,
            env=dict(env),
            labels=dict(labels),
            idle_timeout_s=idle_timeout_s,
            user=user,
            owner=owner,
            mounts=checked_mounts,
            lease_ttl_s=lease_ttl_s,
            idempotency_key=idempotency_key,
        )
        with self.gate.starting_slots():
            return await self.add(sandbox, impl)

    def admit(
        self, count: int, memory_bytes: int, labels: dict[str, str], elsewhere: str, *, starting: bool = False
    ) -> None:
        """The admission of `count` new sandboxes with these labels and `memory_bytes` each, as
        create's: refused while the node drains (UNAVAILABLE, saying `elsewhere` where to go),
        then by the rate of creates, the node's sandbox count and its memory (RESOURCE_EXHAUSTED);
        with `starting`, they are about to start: the starts under way are checked too, and their
        tokens of the rate spent (the caller then holds their start slots, gate.starting_slots).
        Takes no table entry: the caller puts them in the table (reserve, add) with no await in
        between, so that concurrent admissions cannot both take the last of the capacity."""
        paced = self._pass_drain(labels, elsewhere)
        self._admit(count, memory_bytes, paced=paced)
        if starting:
            self._admit_starts(count, paced=paced)

    def reserve(self, sandboxes: Iterable[Sandbox]) -> None:
        """Enters admitted sandboxes in the table before they are brought up (add), so that they
        count against the node's capacity from the moment they were admitted."""
        for sandbox in sandboxes:
            self._sandboxes[sandbox.sandbox_id] = sandbox

    async def add(self, sandbox: Sandbox, impl: Backend, fork: ForkPoint | None = None) -> Sandbox:
        """Brings an admitted sandbox up in the table, from `fork` when given, or leaves no trace
        of it (see create; its caller holds its start slot, CreateGate.starting_slots)."""
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
        # (Only the daemon's own creates: a caller's labels naming a rollout pass nothing.)
        own_rollout = current_caller().internal and self.own_rollout(labels)
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
            sandbox_id=new_sandbox_id(),
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
        """The sandbox `sandbox_id`, if the current caller may see it: every call that names a
        sandbox finds it here (or through `using`), so another caller's answers exactly as one
        that does not exist (callers.py)."""
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None or not current_caller().may_act_on(sandbox.owner):
            raise NotFound(f"no sandbox {sandbox_id!r} on this node")
        sandbox.last_used = time.monotonic()
        if sandbox.state == "running" and sandbox.runtime and not sandbox.runtime.alive():
            sandbox.state = "failed"
        return sandbox

    def list(self, labels: dict[str, str] | None = None) -> list[Sandbox]:
        """Every sandbox of the node with these labels, whoever's (the node's own accounts)."""
        wanted = (labels or {}).items()
        return [sb for sb in self._sandboxes.values() if wanted <= sb.labels.items()]

    def visible(self, labels: dict[str, str] | None = None) -> builtins.list[Sandbox]:
        """The sandboxes with these labels that the current caller may see (ListSandboxes)."""
        caller = current_caller()
        return [sb for sb in self.list(labels) if caller.may_act_on(sb.owner)]

    def __len__(self) -> int:
        return len(self._sandboxes)

    def __contains__(self, sandbox_id: object) -> bool:
        """Whether the table holds `sandbox_id` (starting, running or being torn down)."""
        return sandbox_id in self._sandboxes

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


def new_sandbox_id() -> str:
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


def _default_image(backend: Backend) -> str:
    default = backend.default_image()
    if not default:
        raise InvalidArgument(f"the {backend.name} backend needs an image (this node configures no default)")
    return default
