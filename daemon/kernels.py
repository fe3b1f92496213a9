"""KernelManager: real ipykernel processes inside sandboxes, driven over zmq Unix sockets.

A kernel runs inside its sandbox as the user StartKernel names, by default the sandbox's. Its connection file asks for the `ipc`
transport with the socket prefix in the sandbox's run directory, which the host sees under another
path: the kernel gets the sandbox-side path, the daemon's jupyter_client the host-side one, and
both reach the same Unix sockets through the bind mount: the daemon opens no TCP port. (ipykernel
itself, hard-wired, still listens on 127.0.0.1 of the sandbox's network namespace for output from
forked children, accepting only messages that carry its random token.)

One `KernelProcess` is one incarnation of a kernel (a process, its client and the tasks reading
its channels); `Kernel` is what the caller addresses by id, and survives restarts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.connect import KernelConnectionInfo

from corral.sdk.errors import FailedPrecondition, NotFound, ResourceExhausted

from . import rules
from .backends.base import SandboxRuntime
from .cgroups import CgroupGroup
from .commands import sandbox_environment
from .config import Config
from .files import FileManager
from .fsaccess import create_private_file
from .kernel_events import (
    DISPLAY_LIMIT_BYTES,
    CellDone,
    ErrorOutput,
    GatheredCell,
    KernelEvent,
    LateBuffer,
    StreamCap,
    error_event,
    gather,
    output_event,
)
from .process import KILL_WAIT_S, HostProcess, ProcessExit
from .sandboxes import Sandbox, SandboxManager

log = logging.getLogger(__name__)

DEFAULT_PYTHON = "python3"
MAX_KERNELS_PER_SANDBOX = 32
START_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 30.0
# After a timeout's SIGINT, how long the cell gets to stop before the kernel is killed (code stuck
# in C without checking for signals never sees the interrupt).
INTERRUPT_GRACE_S = 5.0
# A cell that called exit() or quit(): ipykernel stops its loop 0.1 s after the reply and exits;
# if it has not within this, it is killed (it asked to go).
EXIT_GRACE_S = 5.0
# Once the kernel process has exited, how long a cell waits for messages the kernel sent just
# before dying that are still on their way through the channel pumps.
DEATH_DRAIN_S = 0.05
# kernel_info is resent this often until its reply and its iopub status both arrive: a SUB socket
# that connected late misses messages, and the first cell's output must not be lost.
HANDSHAKE_RETRY_S = 0.25
# The client's sockets connect before the kernel binds; zmq retries the connect at this interval.
# With the default (100 ms) the first message waited ~140 ms after the bind here, with 5 ms ~5 ms.
RECONNECT_IVL_MS = 5
UNIX_PATH_MAX = 107
OUTPUT_TAIL_BYTES = 8192
# Ports are just suffixes with the ipc transport: sockets are "<prefix>-1" ... "<prefix>-5".
PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
# Exit status of the probe when the interpreter runs but has no ipykernel.
NO_IPYKERNEL = 3
PROBE_CODE = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('ipykernel') else {NO_IPYKERNEL})"
# SIGINT must reach the kernel, but not a host-side launcher (nsenter) that waits for it as its
# parent and would otherwise die of it: such a launcher starts with SIGINT ignored, which ipykernel
# overrides for the duration of each cell (its pre_handler_hook installs Python's default handler).
IGNORE_SIGINT = ["/bin/sh", "-c", "trap '' INT; exec \"$@\"", "corral-kernel"]


@cache
def _bootstrap_source() -> str:
    return (Path(__file__).parent / "kernel_bootstrap.py").read_text()


def kernel_argv(python: str, output_limit: int) -> list[str]:
    """The command that starts ipykernel with its output governed at `output_limit` bytes per
    stream and cell, and its results and errors cut to the caps (see kernel_bootstrap): the
    sandbox's python runs the bootstrap's text."""
    code = f"{_bootstrap_source()}\nmain({int(output_limit)}, {int(DISPLAY_LIMIT_BYTES)})\n"
    return [python, "-c", code, "--HistoryManager.hist_file=:memory:"]


def describe_death(done: CellDone) -> str:
    """Why a kernel died, in words, from the cell that saw it."""
    if done.signal:
        cause = f"killed by signal {done.signal}"
    else:
        cause = f"exit code {done.exit_code}"
    if done.oom_killed:
        cause += ", out of memory"
    if done.timed_out:
        cause += ", after ignoring the timeout's interrupt"
    return cause


def _is_reply(msg: Any) -> bool:
    return isinstance(msg, dict) and msg.get("msg_type") == "execute_reply"


def _asks_exit(reply: dict) -> bool:
    """The cell called exit() or quit(): ipykernel replies, then stops (exit(True) keeps it)."""
    payload = reply.get("payload") or []
    return any(isinstance(p, dict) and p.get("source") == "ask_exit" and not p.get("keepkernel") for p in payload)


@dataclass(frozen=True)
class KernelInfo:
    sandbox_id: str
    kernel_id: str
    state: str  # "idle" | "busy" | "dead"
    execution_count: int
    python: str
    restarts: int = 0  # by RestartKernel or by a cell that found the kernel dead
    auto_restart: bool = True


# -- one kernel process -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelFiles:
    """Where one kernel's connection file and sockets live, from both sides of the bind mount."""

    host_prefix: str
    sandbox_prefix: str

    @classmethod
    def of(cls, runtime: SandboxRuntime, name: str, user: str = "") -> KernelFiles:
        """In a directory of the run directory that is the kernel's user's alone."""
        host_dir, sandbox_dir = runtime.private_dir(name, user)
        files = cls(f"{host_dir}/k", f"{sandbox_dir}/k")
        longest = max(len(f"{p}-{max(PORTS.values())}".encode()) for p in (files.host_prefix, files.sandbox_prefix))
        if longest > UNIX_PATH_MAX:
            raise FailedPrecondition(
                f"the sandbox's run directory path is too long for Unix sockets ({longest} > {UNIX_PATH_MAX} bytes)"
            )
        return files

    def connection_info(self, prefix: str, key: str) -> KernelConnectionInfo:
        return {
            "transport": "ipc",
            "ip": prefix,
            "shell_port": PORTS["shell_port"],
            "iopub_port": PORTS["iopub_port"],
            "stdin_port": PORTS["stdin_port"],
            "control_port": PORTS["control_port"],
            "hb_port": PORTS["hb_port"],
            "key": key,
            "signature_scheme": "hmac-sha256",
            "kernel_name": "",
        }

    @property
    def connection_file_host(self) -> str:
        return f"{self.host_prefix}.json"

    @property
    def connection_file_sandbox(self) -> str:
        return f"{self.sandbox_prefix}.json"

    def sockets(self) -> list[str]:
        return [f"{self.host_prefix}-{port}" for port in PORTS.values()]

    def write(self, key: str) -> KernelConnectionInfo:
        """Writes the kernel's (sandbox-side) connection file; returns the host-side info. The file
        belongs to the sandbox user, who owns the run directory: the kernel reads and rewrites it."""
        self.remove()
        owner = os.stat(os.path.dirname(self.host_prefix))
        fd = create_private_file(self.connection_file_host, 0o600)
        # fchown on the fd, never chown on the path: the sandbox user owns the directory and could
        # swap the name for a symlink to a host file in between.
        os.fchown(fd, owner.st_uid, owner.st_gid)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.connection_info(self.sandbox_prefix, key), fh)
        return self.connection_info(self.host_prefix, key)

    def remove(self) -> None:
        for path in (self.connection_file_host, *self.sockets()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class Inbox:
    """The messages for one request, put there by the channel pumps: those the request acts on
    (replies, status, execute_input) as Jupyter dicts, outputs as events through the cell's cap."""

    def __init__(self, cap: StreamCap | None = None) -> None:
        self.queue: asyncio.Queue[dict | KernelEvent] = asyncio.Queue()
        self.cap = cap or StreamCap(None)

    def put(self, msg: dict, event: KernelEvent | None) -> None:
        """`msg` and the output event it carries (output_event), if any."""
        if event is None:
            self.queue.put_nowait(msg)
        elif (admitted := self.cap.admit(event)) is not None:
            self.queue.put_nowait(admitted)


class KernelProcess:
    """One running ipykernel and the daemon's client for it. Messages from the shell and iopub
    channels are routed by their parent's msg_id to whichever request is waiting for them; outputs
    nobody waits for (of cells that have finished) go to the late buffer, for the next cell."""

    def __init__(
        self,
        proc: HostProcess,
        client: AsyncKernelClient,
        files: KernelFiles,
        *,
        late: LateBuffer,
        sandbox_cgroup: CgroupGroup | None = None,
    ) -> None:
        self.proc = proc
        self.client = client
        self.files = files
        self.late = late
        # The output cap, the late buffer's: results and errors are cut to it (output_event).
        self.output_limit = late.limit
        self._sandbox_cgroup = sandbox_cgroup
        self._output_tail = bytearray()
        self._listeners: dict[str, Inbox] = {}
        # A cell has reported this incarnation's death (kernel_died), with this cause; later cells
        # are refused, saying it.
        self.death_reported: str | None = None
        self.exited: asyncio.Task = asyncio.ensure_future(proc.run(self._keep_tail, None))
        self._ooms_seen = self.oom_kills()
        self._pumps = [
            asyncio.ensure_future(self._pump(channel)) for channel in (client.shell_channel, client.iopub_channel)
        ]

    @classmethod
    async def start(
        cls,
        runtime: SandboxRuntime,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        leaf: str,
        files: KernelFiles,
        context: zmq.asyncio.Context,
        late: LateBuffer,
        user: str = "",
    ) -> KernelProcess:
        host_info = files.write(secrets.token_hex(16))
        try:
            enter = runtime.enter_command(
                [*argv, "-f", files.connection_file_sandbox], cwd=cwd, leaf=leaf, env=env, user=user
            )
            host_argv = [*IGNORE_SIGINT, *enter.argv] if enter.wrapped else enter.argv
            proc = HostProcess(host_argv, env=enter.env, stdin=None, cgroup=enter.cgroup, cwd=enter.cwd)
        except BaseException:
            files.remove()
            raise
        client = AsyncKernelClient(context=context)
        client.load_connection_info(host_info)
        client.start_channels(hb=False, stdin=False)  # death is seen through the process, not heartbeats
        kernel = cls(proc, client, files, late=late, sandbox_cgroup=getattr(runtime, "cgroup", None))
        try:
            await kernel._handshake()
        except BaseException:
            await kernel.stop()
            raise
        return kernel

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    @property
    def output_tail(self) -> str:
        return self._output_tail.decode(errors="replace").strip()

    def exit_status(self) -> ProcessExit | None:
        """How the process ended, once it has (None while alive, or if that is unknown)."""
        if not self.exited.done() or self.exited.cancelled() or self.exited.exception() is not None:
            return None
        return self.exited.result()

    def oom_kills(self) -> int:
        """OOM kills in the kernel's leaf cgroup and its sandbox's cgroup (as Exec counts them)."""
        leaf = self.proc.cgroup
        return (leaf.oom_kills() if leaf else 0) + (self._sandbox_cgroup.oom_kills() if self._sandbox_cgroup else 0)

    def death(self) -> str:
        """Why the process is gone, in words (as the cell that saw it die said)."""
        if self.death_reported is not None:
            return self.death_reported
        exit = self.exit_status()
        if exit is None:
            return "killed"
        cause = f"killed by signal {exit.signal}" if exit.signal else f"exit code {exit.exit_code}"
        return f"{cause}, out of memory" if self.oom_kills() > self._ooms_seen else cause

    def _keep_tail(self, _stream: int, data: bytes) -> None:
        self._output_tail += data
        del self._output_tail[:-OUTPUT_TAIL_BYTES]

    async def _pump(self, channel) -> None:
        while True:
            try:
                msg = await channel.get_msg()
            except zmq.ZMQError:
                return  # the socket is closed: this incarnation is being stopped
            except Exception:
                log.exception("dropping an unreadable message from a kernel")
                continue
            try:
                self._route(msg)
            except Exception:
                log.exception("dropping a malformed %s message from a kernel", msg.get("msg_type"))

    def _route(self, msg: dict[str, Any]) -> None:
        event = output_event(msg, self.output_limit)
        inbox = self._listeners.get((msg.get("parent_header") or {}).get("msg_id", ""))
        if inbox is not None:
            inbox.put(msg, event)
            return
        # Nobody waits for it: output of a cell that has finished (a thread or child process it
        # left running, or a cell whose caller went away). The next cell delivers it.
        if event is not None:
            self.late.add(event)

    async def _next(self, queue: asyncio.Queue, timeout: float | None) -> Any:
        """The next message for a request; None on timeout or once the kernel has exited (after
        what it sent before dying)."""
        if not queue.empty():
            return queue.get_nowait()
        if self.exited.done():
            # What the kernel sent just before dying may still be on its way through the pumps.
            try:
                return await asyncio.wait_for(queue.get(), DEATH_DRAIN_S)
            except TimeoutError:
                return None
        getter = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait({getter, self.exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()  # a cancelled Queue.get leaves its item in the queue
        if getter.done() and not getter.cancelled():
            return getter.result()
        return None

    async def _handshake(self) -> None:
        """Returns once the kernel answers on shell and publishes on iopub (so our SUB socket is
        connected); raises if it exits or stays silent."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            msg_id = self.client.kernel_info()
            queue = (inbox := Inbox()).queue
            self._listeners[msg_id] = inbox
            try:
                replied = published = False
                retry_at = time.monotonic() + HANDSHAKE_RETRY_S
                while not (replied and published):
                    # Until the reply, wait as long as the kernel takes to boot; after it, the
                    # iopub status is due at once, or the SUB socket missed it.
                    wait_until = deadline if not replied else min(retry_at, deadline)
                    msg = await self._next(queue, max(0.0, wait_until - time.monotonic()))
                    if msg is None:
                        break
                    if not isinstance(msg, dict):
                        continue  # no output is due
                    if msg["msg_type"] == "kernel_info_reply":
                        replied, retry_at = True, time.monotonic() + HANDSHAKE_RETRY_S
                    elif msg["msg_type"] == "status":
                        published = True
                else:
                    self._ooms_seen = self.oom_kills()
                    return
            finally:
                self._listeners.pop(msg_id, None)
            if not self.alive:
                exit = await self.exited
                raise FailedPrecondition(
                    f"the kernel exited during startup (exit code {exit.exit_code}): {self.output_tail or 'no output'}"
                )
            if time.monotonic() >= deadline:
                raise FailedPrecondition(
                    f"the kernel did not answer within {START_TIMEOUT_S:g}s: {self.output_tail or 'no output'}"
                )

    def interrupt(self) -> None:
        """SIGINT to the kernel's process group (the launcher ignores it: see IGNORE_SIGINT)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGINT)

    async def run_cell(self, code: str, timeout_s: float, limit: int | None) -> AsyncGenerator[KernelEvent, None]:
        """Yields the late output that arrived before the cell (if any), the cell's outputs, then
        one CellDone. On timeout the kernel is interrupted; if the cell ignores that too, the
        kernel is killed (reported as died). `limit`: the per-stream cap on the text forwarded
        (None: everything, for gathering). On a kernel that has already died the cell does not run:
        its CellDone says why the kernel died."""
        started = time.monotonic()
        ooms_before = self.oom_kills() if self.alive else self._ooms_seen
        cap = StreamCap(limit)
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        inbox = self._listeners[msg_id] = Inbox(cap)
        count, failed, timed_out, died, exiting = 0, False, False, False, False
        reply: dict | None = None
        idle = False
        deadline = started + timeout_s
        finished = late_delivered = False
        try:
            while reply is None or not idle:
                msg = await self._next(inbox.queue, max(0.0, deadline - time.monotonic()))
                if msg is None:
                    if not self.alive:
                        died = True
                        break
                    if timed_out:  # the interrupt did not stop it
                        await self.stop()
                        died = True
                        break
                    timed_out = True
                    self.interrupt()
                    deadline = time.monotonic() + INTERRUPT_GRACE_S
                    continue
                if not late_delivered and not _is_reply(msg):
                    # The cell's first iopub message: all that was published before it started
                    # (iopub keeps order) has reached the late buffer, and it comes first. Not its
                    # reply, which comes on the shell channel and can overtake the late output.
                    late_delivered = True
                    if (late := self.late.take()) is not None:
                        yield late
                if not isinstance(msg, dict):  # an output event, through the cell's cap
                    failed = failed or isinstance(msg, ErrorOutput)
                    yield msg
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "execute_reply":
                    reply = content
                    count = content.get("execution_count") or count
                    if content.get("status") == "error" and not failed:
                        # The error normally comes on iopub first; if it went missing, the reply has it.
                        failed = True
                        yield error_event(content, self.output_limit)
                    exiting = _asks_exit(content)
                elif kind == "status":
                    idle = content.get("execution_state") == "idle"
                elif kind == "execute_input":
                    count = content.get("execution_count") or count
            if exiting and not died:
                # exit() / quit(): the kernel goes away right after its reply; the cell reports
                # that, with the exit code, rather than an "ok" from a kernel that is gone.
                gone, _ = await asyncio.wait({self.exited}, timeout=EXIT_GRACE_S)
                if not gone:
                    await self.stop()
                died = True
            finished = True
        finally:
            self._listeners.pop(msg_id, None)
            if not finished and self.alive:
                self.interrupt()  # the caller went away mid-cell: free the kernel for the next one
        if not late_delivered and (late := self.late.take()) is not None:
            yield late
        if reply is not None:
            # Once every output has arrived (after the idle status; the reply, on another
            # channel, can overtake the last of them).
            cap.count_totals(reply.get("corral_output"))
        exit = self.exit_status() if died else None
        ooms = self.oom_kills()
        oom_killed, self._ooms_seen = ooms > ooms_before, ooms
        done = CellDone(
            count,
            failed,
            timed_out,
            died,
            int((time.monotonic() - started) * 1000),
            exit_code=exit.exit_code if exit else 0,
            signal=exit.signal if exit else 0,
            oom_killed=oom_killed,
            truncated=cap.truncated,
            stdout_total_bytes=cap.totals["stdout"],
            stderr_total_bytes=cap.totals["stderr"],
            displays_dropped=cap.displays_dropped,
        )
        if died and self.death_reported is None:
            self.death_reported = describe_death(done)
        yield done

    async def stop(self) -> None:
        """Kills the kernel's tree and closes the client. No shutdown_request: nothing of the
        kernel's state is kept, and a kill cannot hang on a busy kernel."""
        for pump in self._pumps:
            pump.cancel()
        if not self.exited.done():
            # Killed rather than cancelled: HostProcess.run closes its pipes and pidfd only when
            # it returns normally.
            await self.proc.kill_tree()
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), KILL_WAIT_S)
            except TimeoutError:
                self.exited.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.exited
        for pump in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        for channel in (self.client.shell_channel, self.client.iopub_channel, self.client.control_channel):
            channel.close()
        self.files.remove()


# -- kernels as the caller sees them -----------------------------------------------------------------


@dataclass
class Kernel:
    sandbox_id: str
    kernel_id: str
    python: str
    cwd: str
    env: dict[str, str]
    name: str  # leaf cgroup and file prefix in the run directory, e.g. "k3"
    user: str = ""  # who it runs as, restarts included ("": the sandbox's default user)
    # A cell that finds the kernel dead restarts it first (within the daemon's limit).
    auto_restart: bool = True
    process: KernelProcess | None = None
    execution_count: int = 0
    busy: bool = False
    restarts: int = 0
    # When cells restarted it (monotonic seconds), within the limit's window.
    auto_restarted_at: collections.deque[float] = field(default_factory=collections.deque)
    # One cell at a time: a second Execute waits for the first (as Jupyter queues them).
    cell_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Start, restart and shutdown never interleave; they do not wait for a running cell.
    lifecycle_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def state(self) -> str:
        if self.process is None or not self.process.alive:
            return "dead"
        return "busy" if self.busy else "idle"

    def info(self) -> KernelInfo:
        return KernelInfo(
            self.sandbox_id,
            self.kernel_id,
            self.state,
            self.execution_count,
            self.python,
            self.restarts,
            self.auto_restart,
        )


class KernelManager:
    def __init__(self, config: Config, sandboxes: SandboxManager, files: FileManager) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self.files = files
        self._kernels: dict[str, dict[str, Kernel]] = {}
        self._zmq: zmq.asyncio.Context | None = None
        sandboxes.on_destroy(self.close_sandbox)

    def _context(self) -> zmq.asyncio.Context:
        """One zmq context (one IO thread) for every kernel client, made on first use."""
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
            self._zmq.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        return self._zmq

    def _get(self, sandbox_id: str, kernel_id: str) -> Kernel:
        self.sandboxes.get(sandbox_id)  # NOT_FOUND for the sandbox first
        kernel = self._kernels.get(sandbox_id, {}).get(kernel_id)
        if kernel is None:
            raise NotFound(f"no kernel {kernel_id!r} in sandbox {sandbox_id}")
        return kernel

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(
        self, sandbox_id: str, python: str, cwd: str, env: dict[str, str], user: str = "", auto_restart: bool = True
    ) -> KernelInfo:
        """Starts a kernel as `user` ("": the sandbox's default user); `auto_restart`: a cell that
        finds it dead restarts it first."""
        python = rules.kernel_python(python) or DEFAULT_PYTHON
        cwd = rules.working_directory(cwd)
        env = rules.environment(env)
        user = rules.user(user)
        with self.sandboxes.using(sandbox_id) as sandbox:
            cwd = await self.files.command_directory(sandbox, cwd)
            kernels = self._kernels.setdefault(sandbox_id, {})
            if len(kernels) >= MAX_KERNELS_PER_SANDBOX:
                raise ResourceExhausted(f"sandbox {sandbox_id} already runs {MAX_KERNELS_PER_SANDBOX} kernels")
            kernel = Kernel(
                sandbox_id,
                f"k-{secrets.token_hex(4)}",
                python,
                cwd,
                dict(env),
                sandbox.runtime.next_leaf("k"),
                user,
                auto_restart,
            )
            kernels[kernel.kernel_id] = kernel  # listed (dead) while it starts, so close_sandbox sees it
            try:
                async with kernel.lifecycle_lock:
                    await self._probe(sandbox.runtime, kernel, self._environment(sandbox, kernel))
                    await self._launch(sandbox, kernel)
            except BaseException:
                kernels.pop(kernel.kernel_id, None)
                raise
            return kernel.info()

    def _environment(self, sandbox: Sandbox, kernel: Kernel) -> dict[str, str]:
        runtime = sandbox.runtime
        assert runtime is not None  # a running sandbox (SandboxManager.using)
        defaults = {
            # IPython's profile and history belong with the daemon's files, not in the workspace:
            # in the kernel's own directory (KernelFiles.of), which its user may write.
            "IPYTHONDIR": f"{runtime.run_dir_sandbox}/{kernel.name}/ipython",
            "JUPYTER_PLATFORM_DIRS": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }
        return sandbox_environment(runtime.home(kernel.user), sandbox.env, {**defaults, **kernel.env})

    async def _probe(self, runtime: SandboxRuntime, kernel: Kernel, env: dict[str, str]) -> None:
        """FAILED_PRECONDITION, saying what is missing, unless `python` runs and has ipykernel.
        find_spec instead of an import: the answer without paying for ipykernel's import twice."""
        proc = runtime.start_process(
            [kernel.python, "-c", PROBE_CODE], env=env, cwd=kernel.cwd, stdin=None, user=kernel.user
        )
        output = bytearray()
        exit = await proc.run(lambda _s, data: output.extend(data[: OUTPUT_TAIL_BYTES - len(output)]), PROBE_TIMEOUT_S)
        detail = output.decode(errors="replace").strip()
        if exit.exit_code == NO_IPYKERNEL:
            raise FailedPrecondition(
                f"{kernel.python} in this sandbox has no ipykernel: install it in the image "
                "(apt-get install python3-ipykernel or pip install ipykernel)"
            )
        if exit.exit_code in (126, 127):
            raise FailedPrecondition(
                f"cannot run {kernel.python} in this sandbox"
                f"{f' in {kernel.cwd}' if kernel.cwd else ''}: {detail or f'exit code {exit.exit_code}'}"
            )
        if exit.exit_code != 0:
            raise FailedPrecondition(
                f"{kernel.python} failed to start (exit code {exit.exit_code}): {detail or 'no output'}"
            )

    async def _launch(self, sandbox: Sandbox, kernel: Kernel, late: LateBuffer | None = None) -> None:
        """Starts the kernel's process; `late`: output of the previous incarnation not yet delivered."""
        runtime = sandbox.runtime
        assert runtime is not None  # a running sandbox (SandboxManager.using)
        kernel.process = await KernelProcess.start(
            runtime,
            kernel_argv(kernel.python, self.config.exec.default_output_limit_bytes),
            env=self._environment(sandbox, kernel),
            cwd=kernel.cwd,
            leaf=kernel.name,
            files=KernelFiles.of(runtime, kernel.name, kernel.user),
            context=self._context(),
            late=late or LateBuffer(self.config.exec.default_output_limit_bytes),
            user=kernel.user,
        )
        kernel.execution_count = 0

    async def restart(self, sandbox_id: str, kernel_id: str) -> KernelInfo:
        """A fresh process under the same id; a cell running in the old one ends as kernel_died.
        Late output of the old one not yet delivered goes to the new one's first cell."""
        with self.sandboxes.using(sandbox_id) as sandbox:
            kernel = self._get(sandbox_id, kernel_id)
            async with kernel.lifecycle_lock:
                await self._relaunch(sandbox, kernel)
            return kernel.info()

    async def _relaunch(self, sandbox: Sandbox, kernel: Kernel) -> None:
        """Replaces the kernel's process (under its lifecycle lock), handing on its late output."""
        if self._kernels.get(kernel.sandbox_id, {}).get(kernel.kernel_id) is not kernel:
            raise NotFound(f"no kernel {kernel.kernel_id!r} in sandbox {kernel.sandbox_id}")  # shut down meanwhile
        late = None
        if kernel.process is not None:
            await kernel.process.stop()
            late, kernel.process = kernel.process.late, None
        kernel.restarts += 1
        await self._launch(sandbox, kernel, late)

    async def _restart_for_cell(self, sandbox: Sandbox, kernel: Kernel) -> str:
        """Restarts a dead kernel for the cell that found it so; returns why it had died. Past the
        limit on automatic restarts, FAILED_PRECONDITION."""
        settings, now = self.config.kernel, time.monotonic()
        recent = kernel.auto_restarted_at
        while recent and now - recent[0] > settings.auto_restart_window_s:
            recent.popleft()
        if len(recent) >= settings.max_auto_restarts:
            limit = (
                f"it was restarted automatically {len(recent)} times within {settings.auto_restart_window_s:g} s"
                if settings.max_auto_restarts
                else "automatic restarts are off"
            )
            raise FailedPrecondition(
                f"{self._dead(kernel)} ({limit}: kernel.max_auto_restarts = {settings.max_auto_restarts})"
            )
        process = kernel.process
        if process is not None and process.death_reported is None:
            # It died since the previous cell: what it sent just before may still be on its way
            # through the pumps, to the late buffer the new process inherits.
            await asyncio.sleep(DEATH_DRAIN_S)
        reason = process.death() if process is not None else "its last restart failed"
        async with kernel.lifecycle_lock:
            if kernel.process is process:  # else RestartKernel replaced it meanwhile
                recent.append(now)
                await self._relaunch(sandbox, kernel)
        log.warning(
            "kernel %s in %s restarted for a cell (it had died: %s)", kernel.kernel_id, kernel.sandbox_id, reason
        )
        return reason

    async def shutdown(self, sandbox_id: str, kernel_id: str) -> None:
        kernel = self._get(sandbox_id, kernel_id)
        self._kernels[sandbox_id].pop(kernel_id, None)
        await self._stop(kernel)
        if kernel.process is not None:
            # Its directory too (IPython's profile): rmtree unlinks symlinks the user left there
            # and never follows them.
            await asyncio.to_thread(shutil.rmtree, os.path.dirname(kernel.process.files.host_prefix), True)

    async def _stop(self, kernel: Kernel) -> None:
        async with kernel.lifecycle_lock:
            if kernel.process is not None:
                await kernel.process.stop()

    def list(self, sandbox_id: str) -> list[KernelInfo]:
        self.sandboxes.get(sandbox_id)
        return [k.info() for k in self._kernels.get(sandbox_id, {}).values()]

    async def close_sandbox(self, sandbox_id: str) -> None:
        """Stops every kernel of a sandbox (called before the sandbox is destroyed)."""
        kernels = self._kernels.pop(sandbox_id, {})
        await asyncio.gather(*(self._stop(k) for k in kernels.values()), return_exceptions=True)

    async def close(self) -> None:
        await asyncio.gather(*(self.close_sandbox(sid) for sid in list(self._kernels)), return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    # -- cells -------------------------------------------------------------------------------------

    def interrupt(self, sandbox_id: str, kernel_id: str) -> None:
        kernel = self._get(sandbox_id, kernel_id)
        if kernel.process is None or not kernel.process.alive:
            raise FailedPrecondition(self._dead(kernel))
        kernel.process.interrupt()

    @staticmethod
    def _dead(kernel: Kernel) -> str:
        cause = f" ({kernel.process.death()})" if kernel.process is not None else ""
        return f"kernel {kernel.kernel_id} is dead{cause}; RestartKernel brings it back"

    def execute(self, sandbox_id: str, kernel_id: str, code: str, timeout_ms: int) -> AsyncGenerator[KernelEvent, None]:
        """Yields the late output of earlier cells (if any), the cell's outputs as the kernel sends
        them, then exactly one CellDone; each stream's text is forwarded up to the output cap.
        Closing the iterator early interrupts the cell. `timeout_ms` 0: the daemon's default."""
        return self._execute(sandbox_id, kernel_id, code, timeout_ms, self.config.exec.default_output_limit_bytes)

    async def _execute(
        self, sandbox_id: str, kernel_id: str, code: str, timeout_ms: int, limit: int | None
    ) -> AsyncGenerator[KernelEvent, None]:
        code = rules.cell_code(code)
        timeout_s = rules.timeout_s(self.config.exec, timeout_ms)
        with self.sandboxes.using(sandbox_id) as sandbox:
            kernel = self._get(sandbox_id, kernel_id)
            async with kernel.cell_lock:
                process, restart_reason = kernel.process, None
                if process is None or process.death_reported is not None or (kernel.auto_restart and not process.alive):
                    if kernel.auto_restart:
                        restart_reason = await self._restart_for_cell(sandbox, kernel)
                        process = kernel.process
                    if process is None or not kernel.auto_restart:
                        raise FailedPrecondition(self._dead(kernel))
                # Without auto_restart, a kernel that died since the previous cell still gets
                # this one: it does not run, and its CellDone says why the kernel died (with
                # what it printed before).
                kernel.busy = True
                cell = process.run_cell(code, timeout_s, limit)
                try:
                    async for event in cell:
                        if isinstance(event, CellDone):
                            if kernel.process is process:
                                kernel.execution_count = max(kernel.execution_count, event.execution_count)
                            if event.kernel_died:
                                log.warning("kernel %s in %s died: %s", kernel_id, sandbox_id, describe_death(event))
                            if restart_reason is not None:
                                event = dataclasses.replace(event, restarted=True, restart_reason=restart_reason)
                        yield event
                finally:
                    # Closed here, under the lock: a cell abandoned midway is interrupted before the
                    # next cell is sent (left to the garbage collector, its interrupt could come
                    # later and hit the next cell, and its output go to a listener nobody reads).
                    await cell.aclose()
                    kernel.busy = False

    async def execute_gathered(self, sandbox_id: str, kernel_id: str, code: str, timeout_ms: int) -> GatheredCell:
        """The cell's events gathered (see gather): stdout and stderr keep head and tail."""
        events = self._execute(sandbox_id, kernel_id, code, timeout_ms, None)
        try:
            return await gather(events, self.config.exec.default_output_limit_bytes)
        finally:
            await events.aclose()
