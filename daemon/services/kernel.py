"""KernelService: translates corral.v1 kernel messages to KernelManager calls and back."""

from __future__ import annotations

from collections.abc import AsyncIterator

from corral.v1 import kernel_pb2 as pb
from corral.v1 import kernel_pb2_grpc

from ..kernel_events import (
    CellDone,
    DisplayOutput,
    ErrorOutput,
    KernelEvent,
    LateOutput,
    ResultOutput,
    StreamOutput,
    rich_size,
)
from ..kernels import KernelInfo, KernelManager

STATES = {"idle": pb.KERNEL_STATE_IDLE, "busy": pb.KERNEL_STATE_BUSY, "dead": pb.KERNEL_STATE_DEAD}
STREAMS = {"stdout": pb.STREAM_NAME_STDOUT, "stderr": pb.STREAM_NAME_STDERR}


def kernel_info(info: KernelInfo) -> pb.KernelInfo:
    return pb.KernelInfo(
        sandbox_id=info.sandbox_id,
        kernel_id=info.kernel_id,
        state=STATES[info.state],
        execution_count=info.execution_count,
        python=info.python,
        restarts=info.restarts,
        auto_restart=info.auto_restart,
    )


def kernel_error(event: ErrorOutput) -> pb.KernelError:
    return pb.KernelError(
        ename=event.ename,
        evalue=event.evalue,
        traceback=event.traceback,
        truncated=event.truncated,
        total_bytes=max(event.total_bytes, rich_size(event)),
    )


def kernel_display(event: DisplayOutput | ResultOutput) -> pb.KernelDisplay:
    if isinstance(event, ResultOutput):
        total = max(event.total_bytes, rich_size(event))
        return pb.KernelDisplay(data=event.data, truncated=event.truncated, total_bytes=total)
    return pb.KernelDisplay(data=event.data, total_bytes=rich_size(event))


def kernel_done(event: CellDone) -> pb.KernelDone:
    return pb.KernelDone(
        execution_count=event.execution_count,
        failed=event.failed,
        timed_out=event.timed_out,
        kernel_died=event.kernel_died,
        duration_ms=event.duration_ms,
        exit_code=event.exit_code,
        signal=event.signal,
        oom_killed=event.oom_killed,
        truncated=event.truncated,
        stdout_total_bytes=event.stdout_total_bytes,
        stderr_total_bytes=event.stderr_total_bytes,
        displays_dropped=event.displays_dropped,
        restarted=event.restarted,
        restart_reason=event.restart_reason,
    )


def late_output(event: LateOutput) -> pb.KernelLateOutput:
    return pb.KernelLateOutput(
        stdout=event.stdout,
        stderr=event.stderr,
        displays=[kernel_display(d) for d in event.displays],
        errors=[kernel_error(e) for e in event.errors],
        truncated=event.truncated,
        stdout_total_bytes=event.stdout_total_bytes,
        stderr_total_bytes=event.stderr_total_bytes,
        dropped=event.dropped,
    )


def execute_response(event: KernelEvent) -> pb.ExecuteResponse:
    if isinstance(event, StreamOutput):
        return pb.ExecuteResponse(
            stream=pb.KernelStream(name=STREAMS.get(event.name, pb.STREAM_NAME_UNSPECIFIED), text=event.text)
        )
    if isinstance(event, DisplayOutput):
        return pb.ExecuteResponse(display=kernel_display(event))
    if isinstance(event, ResultOutput):
        return pb.ExecuteResponse(result=kernel_display(event))
    if isinstance(event, ErrorOutput):
        return pb.ExecuteResponse(error=kernel_error(event))
    if isinstance(event, LateOutput):
        return pb.ExecuteResponse(late_output=late_output(event))
    return pb.ExecuteResponse(done=kernel_done(event))


class KernelServicer(kernel_pb2_grpc.KernelServiceServicer):
    def __init__(self, kernels: KernelManager) -> None:
        self.kernels = kernels

    async def StartKernel(self, request: pb.StartKernelRequest, context) -> pb.StartKernelResponse:
        info = await self.kernels.start(
            request.sandbox_id,
            request.python,
            request.cwd,
            dict(request.env),
            user=request.user,
            auto_restart=request.auto_restart if request.HasField("auto_restart") else True,
        )
        return pb.StartKernelResponse(kernel=kernel_info(info))

    async def Execute(self, request: pb.ExecuteRequest, context) -> AsyncIterator[pb.ExecuteResponse]:
        events = self.kernels.execute(request.sandbox_id, request.kernel_id, request.code, request.timeout_ms)
        try:
            async for event in events:
                yield execute_response(event)
        finally:
            await events.aclose()

    async def ExecuteGathered(self, request: pb.ExecuteGatheredRequest, context) -> pb.ExecuteGatheredResponse:
        cell = await self.kernels.execute_gathered(
            request.sandbox_id, request.kernel_id, request.code, request.timeout_ms
        )
        reply = pb.ExecuteGatheredResponse(
            stdout=cell.stdout,
            stderr=cell.stderr,
            truncated=cell.truncated,
            displays=[kernel_display(d) for d in cell.displays],
        )
        if cell.result is not None:
            reply.result.CopyFrom(kernel_display(cell.result))
        if cell.error is not None:
            reply.error.CopyFrom(kernel_error(cell.error))
        if cell.done is not None:
            reply.done.CopyFrom(kernel_done(cell.done))
        if cell.late is not None:
            reply.late_output.CopyFrom(late_output(cell.late))
        return reply

    async def InterruptKernel(self, request: pb.InterruptKernelRequest, context) -> pb.InterruptKernelResponse:
        self.kernels.interrupt(request.sandbox_id, request.kernel_id)
        return pb.InterruptKernelResponse()

    async def RestartKernel(self, request: pb.RestartKernelRequest, context) -> pb.RestartKernelResponse:
        info = await self.kernels.restart(request.sandbox_id, request.kernel_id)
        return pb.RestartKernelResponse(kernel=kernel_info(info))

    async def ShutdownKernel(self, request: pb.ShutdownKernelRequest, context) -> pb.ShutdownKernelResponse:
        await self.kernels.shutdown(request.sandbox_id, request.kernel_id)
        return pb.ShutdownKernelResponse()

    async def ListKernels(self, request: pb.ListKernelsRequest, context) -> pb.ListKernelsResponse:
        return pb.ListKernelsResponse(kernels=[kernel_info(k) for k in self.kernels.list(request.sandbox_id)])
