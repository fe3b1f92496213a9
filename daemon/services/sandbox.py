"""SandboxService: translates corral.v1 messages to calls on the sandbox table (SandboxManager),
forks and snapshots (ForkManager), commands (ExecManager), files (FileManager, TarTransfer) and
the node (Node), and back. No logic here."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

from corral.sdk.enums import BACKEND_NUMBERS, backend_name
from corral.sdk.errors import InvalidArgument
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import sandbox_pb2_grpc

from ..backends.base import BackendStatus, Limits
from ..execs import ExecManager, ExecOutcome, Exited, Keepalive, Output, Started
from ..files import FileManager
from ..forks import ForkManager, NamedSnapshot
from ..mounts import MountRequest
from ..node import Node, NodeInfo
from ..process import STDERR, STDOUT
from ..rules import CommandRequest
from ..sandboxes import Sandbox, SandboxManager
from ..transfer import TarTransfer

log = logging.getLogger(__name__)

ISOLATION = {
    "none": pb.ISOLATION_LEVEL_NONE,
    "namespaces": pb.ISOLATION_LEVEL_NAMESPACES,
    "container": pb.ISOLATION_LEVEL_CONTAINER,
}
STATES = {
    "starting": pb.SANDBOX_STATE_STARTING,
    "running": pb.SANDBOX_STATE_RUNNING,
    "failed": pb.SANDBOX_STATE_FAILED,
    "stopping": pb.SANDBOX_STATE_STOPPING,
}
LIMIT_KINDS = {
    "memory": pb.LIMIT_KIND_MEMORY,
    "pids": pb.LIMIT_KIND_PIDS,
    "cpu": pb.LIMIT_KIND_CPU,
    "wall_clock": pb.LIMIT_KIND_WALL_CLOCK,
    "network": pb.LIMIT_KIND_NETWORK,
    "disk": pb.LIMIT_KIND_DISK,
}
OUTPUT_STREAMS = {STDOUT: pb.OUTPUT_STREAM_STDOUT, STDERR: pb.OUTPUT_STREAM_STDERR}
FILE_TYPES = {
    "file": pb.FILE_TYPE_FILE,
    "directory": pb.FILE_TYPE_DIRECTORY,
    "symlink": pb.FILE_TYPE_SYMLINK,
    "other": pb.FILE_TYPE_OTHER,
}


def limit_status(limits) -> list[pb.LimitStatus]:
    return [
        pb.LimitStatus(
            kind=LIMIT_KINDS[name],
            enforced=s.enforced,
            mechanism=s.mechanism,
            reason=s.reason,
            approximated=s.approximated,
        )
        for name, s in limits.items()
    ]


def sandbox_message(sb: Sandbox) -> pb.Sandbox:
    runtime = sb.runtime
    host_id_first, host_id_count = runtime.host_id_block() if runtime else (0, 0)
    return pb.Sandbox(
        sandbox_id=sb.sandbox_id,
        backend=BACKEND_NUMBERS[sb.backend],
        image=sb.image,
        state=STATES[sb.state],
        isolation=ISOLATION.get(runtime.isolation if runtime else "", pb.ISOLATION_LEVEL_UNSPECIFIED),
        limits=pb.ResourceLimits(
            memory_bytes=sb.limits.memory_bytes,
            pids=sb.limits.pids,
            cpu_millicores=sb.limits.cpu_millicores,
            disk_bytes=sb.limits.disk_bytes,
        ),
        limit_status=limit_status(sb.limit_support()),
        network=sb.network,
        labels=sb.labels,
        created_at_unix_ms=int(sb.created_at * 1000),
        workdir=runtime.workdir if runtime else "",
        idle_timeout_ms=round(sb.idle_timeout_s * 1000),
        user=sb.user,
        mounts=[
            pb.BindMount(host_path=m.host_path, sandbox_path=m.sandbox_path, writable=not m.read_only)
            for m in sb.mounts
        ],
        lease_ttl_ms=round(sb.lease_ttl_s * 1000),
        lease_expires_at_unix_ms=int(sb.lease_expires_at * 1000),
        idempotency_key=sb.idempotency_key,
        host_id_first=host_id_first,
        host_id_count=host_id_count,
    )


def snapshot_message(named: NamedSnapshot) -> pb.Snapshot:
    return pb.Snapshot(
        name=named.name,
        sandbox_id=named.source.sandbox_id,
        backend=BACKEND_NUMBERS[named.source.backend],
        image=named.source.image,
        size_bytes=named.size_bytes,
        created_at_unix_ms=int(named.created_at * 1000),
        labels=named.source.labels,
    )


def sandbox_summary(sb: Sandbox) -> pb.Sandbox:
    """sandbox_message, or, where one entry cannot be described in full (a bug, a value out of
    range), its id, labels and state with the failure logged: one bad entry never fails a
    listing or a lookup."""
    try:
        return sandbox_message(sb)
    except Exception:
        log.exception("cannot describe sandbox %s in full", sb.sandbox_id)
        return pb.Sandbox(
            sandbox_id=sb.sandbox_id,
            state=STATES.get(sb.state, pb.SANDBOX_STATE_UNSPECIFIED),
            labels=sb.labels,
        )


def backend_info(name: str, status: BackendStatus) -> pb.BackendInfo:
    return pb.BackendInfo(
        backend=BACKEND_NUMBERS[name],
        available=status.available,
        detail=status.detail,
        isolation=ISOLATION.get(status.isolation, pb.ISOLATION_LEVEL_UNSPECIFIED),
        limits=limit_status(status.limits),
    )


def node_info_message(info: NodeInfo) -> pb.GetNodeInfoResponse:
    return pb.GetNodeInfoResponse(
        version=info.version,
        daemon_id=info.daemon_id,
        default_backend=BACKEND_NUMBERS[info.default_backend],
        backends=[backend_info(name, status) for name, status in info.backends.items()],
        cgroup_mode=info.cgroup_mode,
        sandbox_count=info.sandbox_count,
        pools=[
            pb.PoolInfo(
                name=p.name,
                backend=BACKEND_NUMBERS[p.backend],
                image=p.image,
                size=p.size,
                ready=p.ready,
                starting=p.starting,
            )
            for p in info.pools
        ],
        capacity=pb.NodeCapacity(**dataclasses.asdict(info.capacity)),
        draining=info.draining,
        rootless=info.rootless,
        empty=info.empty,
    )


def exit_status(outcome: ExecOutcome) -> pb.ExitStatus:
    e = outcome.exit
    return pb.ExitStatus(
        exit_code=e.exit_code,
        signal=e.signal,
        timed_out=e.timed_out,
        oom_killed=outcome.oom_killed,
        duration_ms=e.duration_ms,
        disk_cap_killed=outcome.disk_cap_killed,
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(
        self,
        manager: SandboxManager,
        forks: ForkManager,
        execs: ExecManager,
        files: FileManager,
        transfer: TarTransfer,
        node: Node,
    ) -> None:
        self.manager = manager
        self.forks = forks
        self.execs = execs
        self.files = files
        self.transfer = transfer
        self.node = node

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context) -> pb.CreateSandboxResponse:
        backend = "" if request.backend == pb.BACKEND_UNSPECIFIED else backend_name(request.backend)
        if backend == "unknown":
            raise InvalidArgument(f"unknown backend value {request.backend}")
        sb = await self.manager.create(
            backend=backend,
            image=request.image,
            limits=Limits(
                request.limits.memory_bytes,
                request.limits.pids,
                request.limits.cpu_millicores,
                request.limits.disk_bytes,
            ),
            network=request.network,
            env=dict(request.env),
            labels=dict(request.labels),
            idle_timeout_ms=request.idle_timeout_ms,
            user=request.user,
            mounts=[MountRequest(m.host_path, m.sandbox_path, m.writable) for m in request.mounts],
            lease_ttl_ms=request.lease_ttl_ms,
            idempotency_key=request.idempotency_key,
        )
        return pb.CreateSandboxResponse(sandbox=sandbox_summary(sb))

    async def GetSandbox(self, request, context) -> pb.GetSandboxResponse:
        return pb.GetSandboxResponse(sandbox=sandbox_summary(self.manager.get(request.sandbox_id)))

    async def ListSandboxes(self, request, context) -> pb.ListSandboxesResponse:
        return pb.ListSandboxesResponse(
            sandboxes=[sandbox_summary(sb) for sb in self.manager.visible(dict(request.labels))]
        )

    async def DestroySandbox(self, request, context) -> pb.DestroySandboxResponse:
        await self.manager.destroy(request.sandbox_id)
        return pb.DestroySandboxResponse()

    async def ForkSandbox(self, request: pb.ForkSandboxRequest, context) -> pb.ForkSandboxResponse:
        children = await self.forks.fork(
            request.sandbox_id, request.count, dict(request.labels), request.snapshot, request.lease_ttl_ms
        )
        return pb.ForkSandboxResponse(sandboxes=[sandbox_summary(sb) for sb in children])

    async def SnapshotSandbox(self, request: pb.SnapshotSandboxRequest, context) -> pb.SnapshotSandboxResponse:
        named = await self.forks.snapshot(request.sandbox_id, request.name)
        return pb.SnapshotSandboxResponse(snapshot=snapshot_message(named))

    async def ListSnapshots(self, request, context) -> pb.ListSnapshotsResponse:
        return pb.ListSnapshotsResponse(snapshots=[snapshot_message(s) for s in self.forks.snapshots()])

    async def DeleteSnapshot(self, request: pb.DeleteSnapshotRequest, context) -> pb.DeleteSnapshotResponse:
        await self.forks.delete_snapshot(request.name)
        return pb.DeleteSnapshotResponse()

    @staticmethod
    def _command(command: pb.Command) -> CommandRequest:
        which = command.WhichOneof("program")
        return CommandRequest(
            argv=list(command.argv.args) if which == "argv" else None,
            shell=command.shell if which == "shell" else None,
            stdin=command.stdin if command.HasField("stdin") else None,
            env=dict(command.env),
            cwd=command.cwd,
            timeout_ms=command.timeout_ms,
            output_limit_bytes=command.output_limit_bytes,
            user=command.user,
        )

    async def Exec(self, request: pb.ExecRequest, context) -> pb.ExecResponse:
        outcome = await self.execs.exec(request.sandbox_id, self._command(request.command))
        return pb.ExecResponse(
            status=exit_status(outcome),
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            truncated=outcome.truncated,
            stdout_total_bytes=outcome.stdout_total,
            stderr_total_bytes=outcome.stderr_total,
        )

    async def ExecStream(self, request: pb.ExecStreamRequest, context) -> AsyncIterator[pb.ExecStreamResponse]:
        spec = self._command(request.command)
        events = self.execs.exec_stream(request.sandbox_id, spec, request.keepalive_interval_ms)
        try:
            async for event in events:
                if isinstance(event, Output):
                    yield pb.ExecStreamResponse(
                        output=pb.ExecOutput(stream=OUTPUT_STREAMS[event.stream], data=event.data)
                    )
                elif isinstance(event, Keepalive):
                    yield pb.ExecStreamResponse(keepalive=pb.ExecKeepalive())
                elif isinstance(event, Started):
                    yield pb.ExecStreamResponse(started=pb.ExecStarted(pid=event.pid))
                elif isinstance(event, Exited):
                    o = event.outcome
                    yield pb.ExecStreamResponse(
                        exited=pb.ExecExited(
                            status=exit_status(o),
                            truncated=o.truncated,
                            stdout_total_bytes=o.stdout_total,
                            stderr_total_bytes=o.stderr_total,
                        )
                    )
        finally:
            await events.aclose()

    async def ReadFile(self, request, context) -> pb.ReadFileResponse:
        data, size, truncated = await self.files.read_file(
            request.sandbox_id, request.path, request.offset, request.limit_bytes
        )
        return pb.ReadFileResponse(data=data, size_bytes=size, truncated=truncated)

    async def WriteFile(self, request, context) -> pb.WriteFileResponse:
        written = await self.files.write_file(
            request.sandbox_id, request.path, request.data, request.mode, request.make_parents
        )
        return pb.WriteFileResponse(bytes_written=written)

    async def ListDir(self, request, context) -> pb.ListDirResponse:
        entries = await self.files.list_dir(request.sandbox_id, request.path)
        return pb.ListDirResponse(
            entries=[
                pb.FileInfo(
                    name=e.name,
                    path=e.path,
                    type=FILE_TYPES[e.kind],
                    size_bytes=e.size,
                    mode=e.mode,
                    modified_unix_ms=e.modified_ns // 1_000_000,
                    symlink_target=e.symlink_target,
                )
                for e in entries
            ]
        )

    async def Upload(self, request_iterator, context) -> pb.UploadResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("message") != "start":
            raise InvalidArgument("the first Upload message must be `start`")

        async def chunks():
            async for message in request_iterator:
                if message.WhichOneof("message") != "chunk":
                    raise InvalidArgument("only `chunk` messages may follow `start`")
                yield message.chunk

        received = await self.transfer.upload(first.start.sandbox_id, first.start.path, chunks())
        return pb.UploadResponse(archive_bytes=received)

    async def Download(self, request, context) -> AsyncIterator[pb.DownloadResponse]:
        async for chunk in self.transfer.download(request.sandbox_id, request.path):
            yield pb.DownloadResponse(chunk=chunk)

    async def GetNodeInfo(self, request, context) -> pb.GetNodeInfoResponse:
        return node_info_message(await self.node.info())

    async def RenewLease(self, request: pb.RenewLeaseRequest, context) -> pb.RenewLeaseResponse:
        sb = self.manager.renew_lease(request.sandbox_id, request.ttl_ms)
        return pb.RenewLeaseResponse(sandbox=sandbox_summary(sb))

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        draining, empty = await self.node.drain(request.drain)
        return pb.DrainResponse(draining=draining, empty=empty)
