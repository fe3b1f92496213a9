"""ShellService: translates corral.v1 shell messages to ShellManager calls and back."""

from __future__ import annotations

from collections.abc import AsyncIterator

from corral.sdk.errors import FailedPrecondition
from corral.v1 import shell_pb2 as pb
from corral.v1 import shell_pb2_grpc

from ..processes import ProcessManager, ProcessSnapshot
from ..shell_session import ShellSession
from ..shells import AttachExited, AttachOutput, ShellManager


def shell_info(sandbox_id: str, session: ShellSession) -> pb.ShellInfo:
    return pb.ShellInfo(
        sandbox_id=sandbox_id, name=session.name, pid=session.pid, turns=session.turns, restarts=session.restarts
    )


def _size(size: pb.TerminalSize, has: bool) -> tuple[int, int] | None:
    return (size.rows, size.cols) if has else None


def process_info(process: ProcessSnapshot) -> pb.ProcessInfo:
    return pb.ProcessInfo(
        sandbox_id=process.sandbox_id,
        process_id=process.process_id,
        argv=process.argv,
        pid=process.pid,
        running=process.running,
        exit_code=process.exit_code,
        output_end=process.output_end,
        output_start=process.output_start,
    )


class ShellServicer(shell_pb2_grpc.ShellServiceServicer):
    def __init__(self, shells: ShellManager, processes: ProcessManager) -> None:
        self.shells = shells
        self.processes = processes

    async def OpenShell(self, request: pb.OpenShellRequest, context) -> pb.OpenShellResponse:
        session = await self.shells.open(
            request.sandbox_id,
            request.name,
            env=dict(request.env),
            cwd=request.cwd,
            size=_size(request.size, request.HasField("size")),
            program=request.program,
            user=request.user,
        )
        return pb.OpenShellResponse(shell=shell_info(request.sandbox_id, session))

    async def RunInShell(self, request: pb.RunInShellRequest, context) -> pb.RunInShellResponse:
        result, plain = await self.shells.run(
            request.sandbox_id,
            request.name,
            request.command,
            timeout_ms=request.timeout_ms,
            idle_timeout_ms=request.idle_timeout_ms,
            output_limit_bytes=request.output_limit_bytes,
            strip_ansi=request.strip_ansi,
            separate_stderr=request.separate_stderr,
        )
        response = pb.RunInShellResponse(
            output=result.output,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            timeout_reason=result.timeout_reason,
            truncated=result.truncated,
            output_total_bytes=result.output_total,
            duration_ms=result.duration_ms,
            shell_restarted=result.shell_restarted,
            disk_cap_killed=result.disk_cap_killed,
        )
        if plain is not None:
            response.output_plain = plain
        if result.stderr is not None:
            response.stderr = result.stderr
            response.stderr_total_bytes = result.stderr_total
        return response

    async def CloseShell(self, request, context) -> pb.CloseShellResponse:
        await self.shells.close_shell(request.sandbox_id, request.name)
        return pb.CloseShellResponse()

    async def ListShells(self, request, context) -> pb.ListShellsResponse:
        return pb.ListShellsResponse(
            shells=[shell_info(request.sandbox_id, s) for s in self.shells.list(request.sandbox_id)]
        )

    async def Attach(self, request_iterator, context) -> AsyncIterator[pb.AttachResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("message") != "start":
            raise FailedPrecondition("the first Attach message must be `start`")
        start = first.start

        async def inputs():
            async for message in request_iterator:
                kind = message.WhichOneof("message")
                if kind == "start":
                    raise FailedPrecondition("`start` may only come first")
                if kind == "resize":
                    yield "resize", _size(message.resize, True)
                elif kind is not None:
                    yield kind, getattr(message, kind)

        events = self.shells.attach(
            start.sandbox_id,
            size=_size(start.size, start.HasField("size")),
            term=start.term,
            program=start.program,
            inputs=inputs(),
            user=start.user,
        )
        try:
            async for event in events:
                if isinstance(event, AttachOutput):
                    yield pb.AttachResponse(output=event.data)
                elif isinstance(event, AttachExited):
                    yield pb.AttachResponse(exited=pb.AttachExited(exit_code=event.exit_code))
        finally:
            await events.aclose()

    # -- background processes ----------------------------------------------------------------------

    async def StartProcess(self, request: pb.StartProcessRequest, context) -> pb.StartProcessResponse:
        process = await self.processes.start(
            request.sandbox_id,
            argv=list(request.argv),
            shell=request.shell,
            env=dict(request.env),
            cwd=request.cwd,
            user=request.user,
            size=_size(request.size, request.HasField("size")),
            term=request.term,
            interactive=request.interactive,
            buffer_bytes=request.buffer_bytes,
        )
        return pb.StartProcessResponse(process=process_info(process.snapshot()))

    async def ReadProcessOutput(self, request: pb.ReadProcessOutputRequest, context) -> pb.ReadProcessOutputResponse:
        start, data, process = await self.processes.read(
            request.sandbox_id,
            request.process_id,
            offset=request.offset,
            max_bytes=request.max_bytes,
            wait_ms=request.wait_ms,
        )
        return pb.ReadProcessOutputResponse(
            data=data,
            offset=start,
            dropped_bytes=start - request.offset,
            next_offset=start + len(data),
            process=process_info(process),
        )

    async def WriteProcessInput(self, request: pb.WriteProcessInputRequest, context) -> pb.WriteProcessInputResponse:
        await self.processes.write(request.sandbox_id, request.process_id, request.data)
        return pb.WriteProcessInputResponse()

    async def SignalProcess(self, request: pb.SignalProcessRequest, context) -> pb.SignalProcessResponse:
        process = self.processes.signal(request.sandbox_id, request.process_id, request.signal)
        return pb.SignalProcessResponse(process=process_info(process))

    async def WaitProcess(self, request: pb.WaitProcessRequest, context) -> pb.WaitProcessResponse:
        process = await self.processes.wait(request.sandbox_id, request.process_id, request.timeout_ms)
        return pb.WaitProcessResponse(process=process_info(process))

    async def CloseProcess(self, request: pb.CloseProcessRequest, context) -> pb.CloseProcessResponse:
        await self.processes.close_process(request.sandbox_id, request.process_id)
        return pb.CloseProcessResponse()

    async def ListProcesses(self, request: pb.ListProcessesRequest, context) -> pb.ListProcessesResponse:
        return pb.ListProcessesResponse(processes=[process_info(p) for p in self.processes.list(request.sandbox_id)])
