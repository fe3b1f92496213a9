"""ExecManager: one-off commands in sandboxes (Exec and ExecStream, and the daemon's own commands,
such as the tar of uploads and downloads), run to completion or streamed as events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from . import rules
from .commands import sandbox_environment
from .config import Config
from .files import FileManager
from .metrics import Metrics
from .output import HeadTailBuffer
from .process import ProcessExit
from .sandboxes import Sandbox, SandboxManager

# Output a streamed command may have waiting for its client (ExecStream, Download): past this the
# daemon stops reading the command's pipes until the client catches up, so memory stays bounded
# whatever the command produces and however slowly the client reads.
STREAM_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class ExecOutcome:
    exit: ProcessExit
    oom_killed: bool
    stdout: bytes
    stderr: bytes
    truncated: bool
    stdout_total: int
    stderr_total: int
    # The daemon killed the sandbox's processes for its disk cap while the command ran.
    disk_cap_killed: bool = False


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


class ExecManager:
    def __init__(self, config: Config, sandboxes: SandboxManager, files: FileManager, metrics: Metrics) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self.files = files
        self.metrics = metrics

    async def exec(self, sandbox_id: str, request: rules.CommandRequest) -> ExecOutcome:
        """Runs a caller's command to completion (the request rules apply)."""
        return await self.run_command(sandbox_id, rules.command(self.config.exec, request))

    def exec_stream(
        self, sandbox_id: str, request: rules.CommandRequest, keepalive_ms: int
    ) -> AsyncGenerator[Started | Output | Keepalive | Exited, None]:
        """Streams a caller's command (the request rules apply); see stream_command."""
        spec = rules.command(self.config.exec, request)
        return self.stream_command(sandbox_id, spec, rules.keepalive_s(keepalive_ms))

    async def run_command(self, sandbox_id: str, spec: rules.CommandSpec) -> ExecOutcome:
        """Runs a checked command to completion (the daemon's own commands come here directly)."""
        with self.sandboxes.using(sandbox_id) as sandbox:
            spec = await self._in_directory(sandbox, spec)
            buffers = {1: HeadTailBuffer(spec.output_limit), 2: HeadTailBuffer(spec.output_limit)}
            oom_before = _sandbox_ooms(sandbox)
            disk_before = sandbox.runtime.disk_kills()
            proc = self._start(sandbox, spec)
            exit = await proc.run(lambda stream, data: buffers[stream].write(data), spec.timeout_s)
            out, err = buffers[1], buffers[2]
            return self._outcome(
                sandbox,
                proc,
                exit,
                (oom_before, disk_before),
                (out.getvalue(), out.total),
                (err.getvalue(), err.total),
                out.truncated or err.truncated,
            )

    async def stream_command(
        self, sandbox_id: str, spec: rules.CommandSpec, keepalive_s: float
    ) -> AsyncGenerator[Started | Output | Keepalive | Exited, None]:
        """Yields one Started, then Output/Keepalive events, then one Exited. Closing the iterator
        early (the client went away) kills the command's tree."""
        with self.sandboxes.using(sandbox_id) as sandbox:
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
            disk_before = sandbox.runtime.disk_kills()
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
                    self._outcome(
                        sandbox, proc, exit, (oom_before, disk_before), (b"", totals[1]), (b"", totals[2]), truncated
                    )
                )
            finally:
                if getter is not None and not getter.done():
                    getter.cancel()
                if not runner.done():
                    runner.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await runner

    async def _in_directory(self, sandbox: Sandbox, spec: rules.CommandSpec) -> rules.CommandSpec:
        """`spec` with its cwd resolved inside the sandbox (FileManager.command_directory)."""
        cwd = await self.files.command_directory(sandbox, spec.cwd)
        return spec if cwd == spec.cwd else replace(spec, cwd=cwd)

    def _start(self, sandbox: Sandbox, spec: rules.CommandSpec):
        runtime = sandbox.runtime
        assert runtime is not None  # a running sandbox (SandboxManager.using)
        argv = spec.argv if spec.argv is not None else runtime.shell_argv(spec.shell or "")
        env = sandbox_environment(runtime.home(spec.user), sandbox.env, spec.env)
        self.metrics.execs.labels(sandbox.backend).inc()
        return runtime.start_process(argv, env=env, cwd=spec.cwd, stdin=spec.stdin, user=spec.user)

    def _outcome(self, sandbox, proc, exit: ProcessExit, before: tuple[int, int], out, err, truncated) -> ExecOutcome:
        """`before`: the sandbox's OOM kills and disk cap kills when the command started."""
        oom_before, disk_before = before
        oom = proc.cgroup is not None and proc.oom_kills() + _sandbox_ooms(sandbox) > oom_before
        disk_killed = bool(exit.signal) and sandbox.runtime.disk_kills() > disk_before
        if exit.timed_out:
            self.metrics.exec_timeouts.labels(sandbox.backend).inc()
        return ExecOutcome(exit, oom, out[0], err[0], truncated, out[1], err[1], disk_killed)


def _sandbox_ooms(sandbox: Sandbox) -> int:
    cgroup = getattr(sandbox.runtime, "cgroup", None)
    return cgroup.oom_kills() if cgroup else 0
