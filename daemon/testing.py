"""Test support: a daemon whose sandboxes are plain host processes, for testing without root.

`FakeBackend` is a STAND-IN, not a sandbox: its "sandboxes" run commands, shells and kernels as
the calling user, directly on the host, in a per-sandbox workspace directory, with no namespaces,
no cgroups, no uid of their own and no limits (every limit reports "not enforced"). What it keeps
is everything around isolation: the daemon's managers, request rules, idle reaper, teardown order,
state records, the SDK over a real gRPC socket and the rollout pipeline all run unchanged on it,
so they can be tested in seconds as any user (`make test-unit`). The real backends are tested
by the integration suite.

    async with embedded_daemon(backend_classes=fake_backends()) as address:
        async with AsyncClient(address) as client: ...

Processes a fake sandbox starts carry its id in their environment (CORRAL_FAKE_SANDBOX), which is
how destroying it finds and kills them all, background children included.

It cannot honour a `user` or bind mounts (there is no user namespace, no mount namespace): it
echoes what the daemon gave it instead, so tests can see what reaches a backend. Every program it
starts finds in its environment CORRAL_FAKE_USER, the user it was asked to run as (the call's
`user`, else the sandbox's default, SandboxSpec.user), and CORRAL_FAKE_MOUNTS, the sandbox's
SandboxSpec.mounts as JSON: [[host_path, sandbox_path, read_only], ...].
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from corral.sdk.errors import InvalidArgument

from .backends.base import Backend, BackendContext, BackendStatus, EnterCommand, ManagedSandbox, SandboxSpec
from .backends.nsenter import HOST_ENV, inside_env
from .callers import Caller, the_daemon, uid_owner
from .cgroups import LimitSupport
from .config import Config
from .fsaccess import SandboxFiles
from .interceptors import CallerOf
from .uids import UidPool

MARKER = "CORRAL_FAKE_SANDBOX"
USER_ECHO = "CORRAL_FAKE_USER"
MOUNTS_ECHO = "CORRAL_FAKE_MOUNTS"
KILL_TIMEOUT_S = 5.0
NOT_ENFORCED = LimitSupport(False, reason="fake backend (test stand-in): no isolation, no limits")


@dataclass
class FakeSettings:
    """The fake backend has no settings."""

    def validate(self) -> None:
        pass


class CallerUid(UidPool):
    """Every fake sandbox runs as the caller: the one uid there is, handed out any number of times."""

    def __init__(self) -> None:
        super().__init__(os.getuid(), 1, block=1)

    def take(self) -> int:
        return os.getuid()

    def give_back(self, uid: int) -> None:
        pass


class FakeSandbox(ManagedSandbox):
    isolation = "none"
    owns_cgroup = False  # no cgroups at all

    def __init__(self, backend: Backend, spec: SandboxSpec, uid: int) -> None:
        super().__init__(backend, spec, uid)
        self.gid = os.getgid()  # the caller's own group: an unprivileged caller can chown to no other
        self._running = False

    async def launch(self) -> None:
        # The host paths themselves: there is no mount namespace to place them elsewhere.
        self.workdir = str(self.workspace)
        self.run_dir_sandbox = self.run_dir_host
        self._running = True

    async def shutdown(self) -> None:
        self._running = False

    def alive(self) -> bool:
        return self._running

    def make_file_access(self) -> SandboxFiles:
        return SandboxFiles("/", self.workdir, None, None, self.context.max_file_bytes)

    def enter_command(
        self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str], user: str = ""
    ) -> EnterCommand:
        mounts = [[m.host_path, m.sandbox_path, m.read_only] for m in self.spec.mounts]
        marked = {
            **env,
            MARKER: self.spec.sandbox_id,
            USER_ECHO: user or self.spec.user,
            MOUNTS_ECHO: json.dumps(mounts),
        }
        return EnterCommand(inside_env(argv, marked), None, cwd or self.workdir, wrapped=False, env=dict(HOST_ENV))

    async def kill_processes(self) -> None:
        await asyncio.to_thread(kill_marked, self.spec.sandbox_id)


def marked_pids(sandbox_id: str) -> set[int]:
    """The caller's processes that carry this fake sandbox's marker."""
    needle = f"{MARKER}={sandbox_id}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def kill_marked(sandbox_id: str) -> bool:
    """SIGKILLs every process of the fake sandbox; True once none is left."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while pids := marked_pids(sandbox_id):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class FakeBackend(Backend):
    """See the module docstring: host processes as the caller, for tests only."""

    name = "fake"
    Settings = FakeSettings
    sandbox_class = FakeSandbox

    def probe(self) -> BackendStatus:
        limits = {kind: NOT_ENFORCED for kind in ("memory", "pids", "cpu", "network")}
        limits["wall_clock"] = LimitSupport(True, "process group kill")
        return BackendStatus(True, "FAKE BACKEND (test stand-in): host processes, no isolation", "none", limits)

    def default_image(self) -> str:
        return "host"

    def __init__(self, context: BackendContext) -> None:
        super().__init__(dataclasses.replace(context, uids=CallerUid()))

    async def check_image(self, image: str) -> None:
        if image not in ("", "host"):
            raise InvalidArgument(f'the fake backend only runs the "host" image, not {image!r}')

    async def release(self, record: dict) -> None:
        # A crashed daemon's fake sandbox: its processes still carry its marker.
        await asyncio.to_thread(kill_marked, record.get("sandbox_id", ""))


def fake_backends(name: str = "local") -> dict[str, type[Backend]]:
    """The backend table of a daemon whose `name` backend (the default one, "local") is the fake:
    pass it as `backend_classes` to `Daemon` or `embedded_daemon`. The wire still calls it by
    that name; GetNodeInfo's detail and every limit status say what it really is."""
    return {name: FakeBackend}


def callers_by_token(context: grpc.aio.ServicerContext) -> Caller:
    """Tells callers apart by the bearer token they send, for tests that need several users in
    one process (where the peer credentials are all the test's): `Client(address, token="uid:1001")`
    calls as uid 1001 (uid 0 is an admin), and a call without a token is the daemon's own (its
    rollout service's)."""
    metadata = dict(context.invocation_metadata() or ())
    token = str(metadata.get("authorization", "")).removeprefix("Bearer ")
    if not token:
        return the_daemon()
    uid = int(token.removeprefix("uid:"))
    return Caller(uid_owner(uid), admin=uid == 0)


@contextlib.contextmanager
def fake_daemon_in_a_thread(config: Config | None = None, *, caller_of: CallerOf | None = None) -> Iterator[str]:
    """A daemon on the fake backend (`embedded_daemon`) serving from an event loop of its own
    thread, for tests whose clients block (`Client`, the generated stubs); yields its address and
    stops it on exit. `caller_of`: as embedded_daemon's."""
    from .embedded import embedded_daemon

    loop = asyncio.new_event_loop()
    started: queue.Queue[str | BaseException] = queue.Queue()
    stopping = asyncio.Event()

    async def serve() -> None:
        try:
            async with embedded_daemon(config, backend_classes=fake_backends(), caller_of=caller_of) as address:
                started.put(address)
                await stopping.wait()
        except BaseException as error:
            started.put(error)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), name="fake-daemon", daemon=True)
    thread.start()
    try:
        address = started.get()
        if isinstance(address, BaseException):
            raise address
        yield address
    finally:
        loop.call_soon_threadsafe(stopping.set)
        thread.join(60)
        loop.close()
