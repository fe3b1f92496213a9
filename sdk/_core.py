"""The wire logic both clients share, without any I/O: request builders, call deadlines, decoders from
protobuf to the types in `corral.sdk.types`, the ExecStream and kernel Execute event-order checks,
the ReadFile plan, and the messages of an interactive shell (Attach).

The sync and async clients only choose which channel to send these requests on.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar, cast

from corral.sdk.enums import backend_name, backend_number, enum_name
from corral.sdk.errors import FailedPrecondition, InvalidArgument, ProtocolError
from corral.sdk.types import (
    BackendStatus,
    DrainState,
    ExecEvent,
    ExecExited,
    ExecKeepalive,
    ExecOutput,
    ExecResult,
    ExecStarted,
    FileEntry,
    FileType,
    IsolationLevel,
    KernelDisplayEvent,
    KernelDoneEvent,
    KernelErrorEvent,
    KernelErrorInfo,
    KernelEvent,
    KernelInfo,
    KernelLateOutput,
    KernelResult,
    KernelResultEvent,
    KernelState,
    KernelStreamEvent,
    LimitKind,
    LimitStatus,
    Mount,
    NodeCapacity,
    NodeInfo,
    OutputStreamName,
    PoolInfo,
    ResourceLimits,
    SandboxInfo,
    SandboxState,
    ShellInfo,
    ShellResult,
    ShellTimeoutReason,
    SnapshotInfo,
)
from corral.v1 import kernel_pb2 as kernel_pb
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import shell_pb2 as shell_pb

# The deadline of calls other than exec, unless the client is given another.
DEFAULT_CALL_TIMEOUT_S = 30.0
# An exec call's deadline is the command's own timeout plus this: after the timeout the daemon
# still has to kill the process tree and send the partial output back, and that reply should win
# over a client-side DEADLINE_EXCEEDED, which would lose the output.
EXEC_DEADLINE_MARGIN_S = 10.0
# A call deadline that means none: an exec whose command timeout is left to the daemon (its
# exec.default_timeout_s, which the client does not know) waits for the daemon's answer, which
# comes once the daemon has killed the command at the latest.
NO_DEADLINE = math.inf
# A shell command's deadline is its timeout plus this: on expiry the daemon sends SIGINT, then
# stdin EOF, then SIGKILL, with a grace period between each (a few seconds in all), and only then
# answers with the partial output.
SHELL_DEADLINE_MARGIN_S = 15.0
DEFAULT_SHELL_NAME = "main"
# A cell's deadline is its timeout plus this: on expiry the daemon interrupts the kernel, waits a
# grace period, and kills the kernel if the cell ignored the interrupt.
KERNEL_DEADLINE_MARGIN_S = 15.0
# StartKernel and RestartKernel: the daemon checks the interpreter (up to 30 s) and then waits up
# to 60 s for the kernel to answer, so their deadline is longer than the usual call's.
KERNEL_START_TIMEOUT_S = 100.0

Command = str | Sequence[str]
# A bind mount as create_sandbox takes it: a Mount, or (host_path, sandbox_path[, writable]).
MountSpec = Mount | tuple[str, str] | tuple[str, str, bool]


# ---- deadlines -------------------------------------------------------------------------------


def call_deadline(timeout: float | None, default: float) -> float:
    """Seconds a non-exec call may take: the per-call timeout if given, else the client default."""
    seconds = default if timeout is None else timeout
    if seconds <= 0:
        raise InvalidArgument(f"timeout must be positive, got {seconds}")
    return seconds


def grpc_timeout(timeout: float | None, default: float) -> float | None:
    """The `timeout` argument of a gRPC call: call_deadline's seconds, or None for NO_DEADLINE."""
    seconds = call_deadline(timeout, default)
    return None if seconds == NO_DEADLINE else seconds


def exec_deadline(timeout: float | None) -> float:
    """Seconds an Exec or ExecStream call may take in all, for a command timeout in seconds (None:
    the daemon's default, so NO_DEADLINE)."""
    return NO_DEADLINE if timeout is None else timeout + EXEC_DEADLINE_MARGIN_S


def shell_deadline(timeout: float | None) -> float:
    """Seconds a RunInShell call may take in all, for a command timeout in seconds (None: the
    daemon's default, so NO_DEADLINE)."""
    return NO_DEADLINE if timeout is None else timeout + SHELL_DEADLINE_MARGIN_S


def kernel_deadline(timeout: float | None) -> float:
    """Seconds an Execute or ExecuteGathered call may take in all, for a cell timeout in seconds
    (None: the daemon's default, so NO_DEADLINE)."""
    return NO_DEADLINE if timeout is None else timeout + KERNEL_DEADLINE_MARGIN_S


# ---- requests --------------------------------------------------------------------------------


def build_create_sandbox_request(
    *,
    image: str | None,
    backend: str | None,
    memory_bytes: int | None,
    pids: int | None,
    cpu_millicores: int | None,
    disk_bytes: int | None,
    network: bool,
    env: Mapping[str, str] | None,
    labels: Mapping[str, str] | None,
    idle_timeout: float | None,
    user: str | None = None,
    mounts: Iterable[MountSpec] | None = None,
    lease_ttl: float | None = None,
    idempotency_key: str | None = None,
) -> pb.CreateSandboxRequest:
    return pb.CreateSandboxRequest(
        backend=backend_number(backend),
        image=image or "",
        limits=pb.ResourceLimits(
            memory_bytes=_non_negative("memory_bytes", memory_bytes),
            pids=_non_negative("pids", pids),
            cpu_millicores=_non_negative("cpu_millicores", cpu_millicores),
            disk_bytes=_non_negative("disk_bytes", disk_bytes),
        ),
        network=network,
        env=_string_map("env", env),
        labels=_string_map("labels", labels),
        idle_timeout_ms=0 if idle_timeout is None else _positive_ms("idle_timeout", idle_timeout),
        user=_user(user),
        mounts=[_bind_mount(mount) for mount in mounts or ()],
        lease_ttl_ms=0 if lease_ttl is None else _positive_ms("lease_ttl_s", lease_ttl),
        idempotency_key=idempotency_key or "",
    )


def build_renew_lease_request(sandbox_id: str, ttl: float) -> pb.RenewLeaseRequest:
    return pb.RenewLeaseRequest(sandbox_id=sandbox_id, ttl_ms=_positive_ms("ttl_s", ttl))


def build_drain_request(drain: bool) -> pb.DrainRequest:
    return pb.DrainRequest(drain=drain)


def drain_state_from_proto(response: pb.DrainResponse) -> DrainState:
    return DrainState(draining=response.draining, empty=response.empty)


def build_get_sandbox_request(sandbox_id: str) -> pb.GetSandboxRequest:
    return pb.GetSandboxRequest(sandbox_id=sandbox_id)


def build_list_sandboxes_request(labels: Mapping[str, str] | None) -> pb.ListSandboxesRequest:
    return pb.ListSandboxesRequest(labels=_string_map("labels", labels))


def build_destroy_sandbox_request(sandbox_id: str) -> pb.DestroySandboxRequest:
    return pb.DestroySandboxRequest(sandbox_id=sandbox_id)


def build_fork_sandbox_request(
    sandbox_id: str,
    count: int,
    labels: Mapping[str, str] | None,
    snapshot: str = "",
    lease_ttl: float | None = None,
) -> pb.ForkSandboxRequest:
    return pb.ForkSandboxRequest(
        sandbox_id=sandbox_id,
        count=count,
        labels=_string_map("labels", labels),
        snapshot=snapshot,
        lease_ttl_ms=0 if lease_ttl is None else _positive_ms("lease_ttl_s", lease_ttl),
    )


def snapshot_info_from_proto(snapshot: pb.Snapshot) -> SnapshotInfo:
    return SnapshotInfo(
        name=snapshot.name,
        sandbox_id=snapshot.sandbox_id,
        backend=backend_name(snapshot.backend),
        image=snapshot.image,
        size_bytes=snapshot.size_bytes,
        created_at=_datetime_from_ms(snapshot.created_at_unix_ms),
        labels=dict(snapshot.labels),
    )


def build_node_info_request() -> pb.GetNodeInfoRequest:
    return pb.GetNodeInfoRequest()


def build_command(
    cmd: Command,
    *,
    stdin: bytes | str | None,
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    output_limit: int | None,
    user: str | None = None,
) -> pb.Command:
    """A Command message: a str runs under the sandbox's shell, a list of str runs as argv. A
    `timeout` of None sends 0: the daemon's default; a `user` of None, the sandbox's user."""
    command = pb.Command(
        env=_string_map("env", env),
        cwd=cwd or "",
        timeout_ms=_timeout_ms(timeout),
        output_limit_bytes=_non_negative("output_limit", output_limit),
        user=_user(user),
    )
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("the shell command is empty")
        command.shell = cmd
    elif isinstance(cmd, bytes):
        raise InvalidArgument("pass the command as str (shell) or a list of str (argv), not bytes")
    else:
        args = list(cmd)
        if not args:
            raise InvalidArgument("the argv list is empty")
        if not all(isinstance(arg, str) for arg in args):
            raise InvalidArgument(f"argv items must be str, got {args!r}")
        command.argv.args.extend(args)
    if stdin is not None:
        # Setting the optional field, even to b"", is what tells the daemon to feed stdin.
        command.stdin = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    return command


def build_exec_request(
    sandbox_id: str,
    cmd: Command,
    *,
    stdin: bytes | str | None,
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    output_limit: int | None,
    user: str | None = None,
) -> pb.ExecRequest:
    return pb.ExecRequest(
        sandbox_id=sandbox_id,
        command=build_command(
            cmd, stdin=stdin, env=env, cwd=cwd, timeout=timeout, output_limit=output_limit, user=user
        ),
    )


def build_exec_stream_request(
    sandbox_id: str,
    cmd: Command,
    *,
    stdin: bytes | str | None,
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    output_limit: int | None,
    keepalive: float | None,
    user: str | None = None,
) -> pb.ExecStreamRequest:
    return pb.ExecStreamRequest(
        sandbox_id=sandbox_id,
        command=build_command(
            cmd, stdin=stdin, env=env, cwd=cwd, timeout=timeout, output_limit=output_limit, user=user
        ),
        keepalive_interval_ms=0 if keepalive is None else _positive_ms("keepalive", keepalive),
    )


def build_list_dir_request(sandbox_id: str, path: str) -> pb.ListDirRequest:
    return pb.ListDirRequest(sandbox_id=sandbox_id, path=path)


def build_download_request(sandbox_id: str, path: str) -> pb.DownloadRequest:
    return pb.DownloadRequest(sandbox_id=sandbox_id, path=path)


def build_write_file_request(
    sandbox_id: str, path: str, data: bytes | str, *, mode: int | None, make_parents: bool
) -> pb.WriteFileRequest:
    return pb.WriteFileRequest(
        sandbox_id=sandbox_id,
        path=path,
        data=data.encode() if isinstance(data, str) else bytes(data),
        mode=_non_negative("mode", mode),
        make_parents=make_parents,
    )


def upload_requests(sandbox_id: str, remote_dir: str, archive_chunks: Iterable[bytes]) -> Iterator[pb.UploadRequest]:
    """The Upload stream: `start` first, as the contract demands, then one message per chunk."""
    yield pb.UploadRequest(start=pb.UploadStart(sandbox_id=sandbox_id, path=remote_dir))
    for chunk in archive_chunks:
        yield pb.UploadRequest(chunk=chunk)


# The most bytes one `read_file` returns; past it, `download` (which streams to disk) is the way.
# The daemon has its own cap for one reply (exec.max_file_bytes, 64 MiB by default).
READ_FILE_MAX_BYTES = 64 << 20


def read_file_plan(
    sandbox_id: str, path: str, *, offset: int, limit: int | None
) -> Generator[pb.ReadFileRequest, pb.ReadFileResponse, bytes]:
    """Yields the ReadFile requests that read `limit` bytes from `offset` (None: to the end of the
    file), is sent each reply, and returns the bytes read.

    A read that would return more than READ_FILE_MAX_BYTES fails with FailedPrecondition after the
    first reply (which tells the file's size), so a huge file never fills this process's memory.
    The daemon caps one reply, so a ranged read may take several calls; a generator keeps that
    loop here, and each client only drives it (`plan.send(reply)`).
    """
    _non_negative("offset", offset)
    if limit is not None:
        _non_negative("limit", limit)
    parts: list[bytes] = []
    received = 0
    while limit is None or received < limit:
        # limit_bytes 0 asks for the rest of the file (the daemon refuses it past its cap).
        wanted = 0 if limit is None else limit - received
        reply = yield pb.ReadFileRequest(sandbox_id=sandbox_id, path=path, offset=offset + received, limit_bytes=wanted)
        remaining = max(reply.size_bytes - offset, received + len(reply.data))
        total = remaining if limit is None else min(limit, remaining)
        if total > READ_FILE_MAX_BYTES:
            raise FailedPrecondition(
                f"read_file of {path!r} would return {total} bytes, more than its limit of {READ_FILE_MAX_BYTES}:"
                " use download(), or read it in ranges (offset, limit)"
            )
        parts.append(reply.data)
        received += len(reply.data)
        if not reply.truncated:
            break
        if not reply.data:
            raise ProtocolError(
                f"ReadFile of {path!r} reported more data at offset {offset + received} but returned none"
            )
    return b"".join(parts)


# ---- shell requests --------------------------------------------------------------------------


def build_open_shell_request(
    sandbox_id: str,
    name: str,
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    rows: int | None,
    cols: int | None,
    program: str | None,
    user: str | None = None,
) -> shell_pb.OpenShellRequest:
    request = shell_pb.OpenShellRequest(
        sandbox_id=sandbox_id,
        name=_shell_name(name),
        env=_string_map("env", env),
        cwd=cwd or "",
        program=program or "",
        user=_user(user),
    )
    size = _terminal_size(rows, cols)
    if size is not None:
        request.size.CopyFrom(size)
    return request


def build_run_in_shell_request(
    sandbox_id: str,
    name: str,
    cmd: str,
    *,
    timeout: float | None,
    idle_timeout: float | None,
    output_limit: int | None,
    strip_ansi: bool,
    separate_stderr: bool = False,
) -> shell_pb.RunInShellRequest:
    if not isinstance(cmd, str):
        raise InvalidArgument(f"a shell command is str (any bash text), got {type(cmd).__name__}")
    return shell_pb.RunInShellRequest(
        sandbox_id=sandbox_id,
        name=_shell_name(name),
        command=cmd,
        timeout_ms=_timeout_ms(timeout),
        idle_timeout_ms=0 if idle_timeout is None else _positive_ms("idle_timeout", idle_timeout),
        output_limit_bytes=_non_negative("output_limit", output_limit),
        strip_ansi=strip_ansi,
        separate_stderr=separate_stderr,
    )


def build_close_shell_request(sandbox_id: str, name: str) -> shell_pb.CloseShellRequest:
    return shell_pb.CloseShellRequest(sandbox_id=sandbox_id, name=_shell_name(name))


def build_list_shells_request(sandbox_id: str) -> shell_pb.ListShellsRequest:
    return shell_pb.ListShellsRequest(sandbox_id=sandbox_id)


def build_attach_start(
    sandbox_id: str,
    *,
    rows: int | None,
    cols: int | None,
    term: str | None,
    program: str | None,
    user: str | None = None,
) -> shell_pb.AttachRequest:
    """The first message of an Attach stream: which sandbox, the terminal size, $TERM, the
    program and who runs it."""
    start = shell_pb.AttachStart(sandbox_id=sandbox_id, term=term or "", program=program or "", user=_user(user))
    size = _terminal_size(rows, cols)
    if size is not None:
        start.size.CopyFrom(size)
    return shell_pb.AttachRequest(start=start)


def build_attach_input(data: bytes) -> shell_pb.AttachRequest:
    return shell_pb.AttachRequest(input=bytes(data))


def build_attach_resize(rows: int, cols: int) -> shell_pb.AttachRequest:
    size = _terminal_size(rows, cols)
    if size is None:
        raise InvalidArgument("a resize needs both rows and cols")
    return shell_pb.AttachRequest(resize=size)


def attach_output_or_exit(response: shell_pb.AttachResponse) -> bytes | int:
    """An Attach reply: terminal output as bytes, or the shell's exit code as int once it ended."""
    kind = response.WhichOneof("message")
    if kind == "output":
        return response.output
    if kind == "exited":
        return response.exited.exit_code
    raise ProtocolError("Attach sent a message with neither output nor exited set")


# ---- kernel requests -------------------------------------------------------------------------


def build_start_kernel_request(
    sandbox_id: str,
    *,
    python: str | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    user: str | None = None,
    auto_restart: bool = True,
) -> kernel_pb.StartKernelRequest:
    return kernel_pb.StartKernelRequest(
        sandbox_id=sandbox_id,
        python=python or "",
        cwd=cwd or "",
        env=_string_map("env", env),
        user=_user(user),
        auto_restart=bool(auto_restart),
    )


def build_execute_request(
    sandbox_id: str, kernel_id: str, code: str, *, timeout: float | None
) -> kernel_pb.ExecuteRequest:
    return kernel_pb.ExecuteRequest(
        sandbox_id=sandbox_id, kernel_id=kernel_id, code=_cell_code(code), timeout_ms=_timeout_ms(timeout)
    )


def build_execute_gathered_request(
    sandbox_id: str, kernel_id: str, code: str, *, timeout: float | None
) -> kernel_pb.ExecuteGatheredRequest:
    return kernel_pb.ExecuteGatheredRequest(
        sandbox_id=sandbox_id, kernel_id=kernel_id, code=_cell_code(code), timeout_ms=_timeout_ms(timeout)
    )


def build_interrupt_kernel_request(sandbox_id: str, kernel_id: str) -> kernel_pb.InterruptKernelRequest:
    return kernel_pb.InterruptKernelRequest(sandbox_id=sandbox_id, kernel_id=kernel_id)


def build_restart_kernel_request(sandbox_id: str, kernel_id: str) -> kernel_pb.RestartKernelRequest:
    return kernel_pb.RestartKernelRequest(sandbox_id=sandbox_id, kernel_id=kernel_id)


def build_shutdown_kernel_request(sandbox_id: str, kernel_id: str) -> kernel_pb.ShutdownKernelRequest:
    return kernel_pb.ShutdownKernelRequest(sandbox_id=sandbox_id, kernel_id=kernel_id)


def build_list_kernels_request(sandbox_id: str) -> kernel_pb.ListKernelsRequest:
    return kernel_pb.ListKernelsRequest(sandbox_id=sandbox_id)


# ---- decoders --------------------------------------------------------------------------------

# enum_name gives one of the contract's value names or "unknown"; the Literal types of
# corral.sdk.types list exactly those (test_sdk_core checks it), hence the casts below.


def sandbox_info_from_proto(sandbox: pb.Sandbox) -> SandboxInfo:
    return SandboxInfo(
        id=sandbox.sandbox_id,
        backend=backend_name(sandbox.backend),
        image=sandbox.image,
        state=cast(SandboxState, enum_name(pb.SandboxState, "SANDBOX_STATE_", sandbox.state)),
        isolation=cast(IsolationLevel, enum_name(pb.IsolationLevel, "ISOLATION_LEVEL_", sandbox.isolation)),
        limits=ResourceLimits(
            memory_bytes=sandbox.limits.memory_bytes,
            pids=sandbox.limits.pids,
            cpu_millicores=sandbox.limits.cpu_millicores,
            disk_bytes=sandbox.limits.disk_bytes,
        ),
        limit_status=tuple(limit_status_from_proto(status) for status in sandbox.limit_status),
        network=sandbox.network,
        labels=dict(sandbox.labels),
        workdir=sandbox.workdir,
        created_at=_datetime_from_ms(sandbox.created_at_unix_ms),
        idle_timeout=sandbox.idle_timeout_ms / 1000 if sandbox.idle_timeout_ms else None,
        user=sandbox.user,
        mounts=tuple(Mount(m.host_path, m.sandbox_path, m.writable) for m in sandbox.mounts),
        lease_ttl=sandbox.lease_ttl_ms / 1000 if sandbox.lease_ttl_ms else None,
        lease_expires_at=(
            _datetime_from_ms(sandbox.lease_expires_at_unix_ms) if sandbox.lease_expires_at_unix_ms else None
        ),
        idempotency_key=sandbox.idempotency_key,
        host_id_first=sandbox.host_id_first,
        host_id_count=sandbox.host_id_count,
    )


def limit_status_from_proto(status: pb.LimitStatus) -> LimitStatus:
    return LimitStatus(
        kind=cast(LimitKind, enum_name(pb.LimitKind, "LIMIT_KIND_", status.kind)),
        enforced=status.enforced,
        mechanism=status.mechanism,
        reason=status.reason,
        approximated=status.approximated,
    )


def exec_result_from_proto(response: pb.ExecResponse) -> ExecResult:
    status = response.status
    return ExecResult(
        exit_code=status.exit_code,
        signal=status.signal,
        stdout=response.stdout,
        stderr=response.stderr,
        timed_out=status.timed_out,
        oom_killed=status.oom_killed,
        truncated=response.truncated,
        duration_ms=status.duration_ms,
        stdout_total_bytes=response.stdout_total_bytes,
        stderr_total_bytes=response.stderr_total_bytes,
        disk_cap_killed=status.disk_cap_killed,
    )


def exec_event_from_proto(response: pb.ExecStreamResponse) -> ExecEvent:
    kind = response.WhichOneof("event")
    if kind == "started":
        return ExecStarted(pid=response.started.pid)
    if kind == "output":
        return ExecOutput(stream=_output_stream_name(response.output.stream), data=response.output.data)
    if kind == "keepalive":
        return ExecKeepalive()
    if kind == "exited":
        exited = response.exited
        return ExecExited(
            exit_code=exited.status.exit_code,
            signal=exited.status.signal,
            timed_out=exited.status.timed_out,
            oom_killed=exited.status.oom_killed,
            truncated=exited.truncated,
            duration_ms=exited.status.duration_ms,
            stdout_total_bytes=exited.stdout_total_bytes,
            stderr_total_bytes=exited.stderr_total_bytes,
            disk_cap_killed=exited.status.disk_cap_killed,
        )
    raise ProtocolError("ExecStream sent an event with none of started/output/keepalive/exited set")


def file_entry_from_proto(info: pb.FileInfo) -> FileEntry:
    return FileEntry(
        name=info.name,
        path=info.path,
        type=cast(FileType, enum_name(pb.FileType, "FILE_TYPE_", info.type)),
        size_bytes=info.size_bytes,
        mode=info.mode,
        modified_at=_datetime_from_ms(info.modified_unix_ms),
        symlink_target=info.symlink_target or None,
    )


def node_info_from_proto(response: pb.GetNodeInfoResponse) -> NodeInfo:
    return NodeInfo(
        version=response.version,
        daemon_id=response.daemon_id,
        default_backend=backend_name(response.default_backend),
        backends=tuple(
            BackendStatus(
                backend=backend_name(backend.backend),
                available=backend.available,
                detail=backend.detail,
                isolation=cast(IsolationLevel, enum_name(pb.IsolationLevel, "ISOLATION_LEVEL_", backend.isolation)),
                limits=tuple(limit_status_from_proto(status) for status in backend.limits),
            )
            for backend in response.backends
        ),
        cgroup_mode=response.cgroup_mode,
        sandbox_count=response.sandbox_count,
        pools=tuple(
            PoolInfo(p.name, backend_name(p.backend), p.image, p.size, p.ready, p.starting) for p in response.pools
        ),
        capacity=_capacity_from_proto(response.capacity),
        draining=response.draining,
        empty=response.empty,
        rootless=response.rootless,
    )


def _capacity_from_proto(capacity: pb.NodeCapacity) -> NodeCapacity:
    values = {f.name: getattr(capacity, f.name) for f in dataclasses.fields(NodeCapacity)}
    return NodeCapacity(**{**values, "images_cached": tuple(capacity.images_cached)})


EventT = TypeVar("EventT")


class StreamDecoder(Protocol):
    """Turns one server stream's responses into typed events, checking their order."""

    def decode(self, response: Any) -> Any: ...

    def finish(self) -> None:
        """Called when the stream ended by itself: raises if its final event never came."""


class ExecEventDecoder:
    """Decodes one ExecStream's responses and enforces the order the contract fixes: exactly one
    `started`, then any `output`/`keepalive`, then exactly one `exited`.

    One instance per stream; `finish()` is called when the stream ends by itself.
    """

    class _Phase(enum.Enum):
        AWAITING_START = enum.auto()
        RUNNING = enum.auto()
        EXITED = enum.auto()

    def __init__(self) -> None:
        self._phase = self._Phase.AWAITING_START

    def decode(self, response: pb.ExecStreamResponse) -> ExecEvent:
        event = exec_event_from_proto(response)
        name = type(event).__name__
        if self._phase is self._Phase.EXITED:
            raise ProtocolError(f"ExecStream sent {name} after the exited event")
        if self._phase is self._Phase.AWAITING_START and not isinstance(event, ExecStarted):
            raise ProtocolError(f"ExecStream sent {name} before the started event")
        if self._phase is self._Phase.RUNNING and isinstance(event, ExecStarted):
            raise ProtocolError("ExecStream sent a second started event")
        if isinstance(event, ExecStarted):
            self._phase = self._Phase.RUNNING
        elif isinstance(event, ExecExited):
            self._phase = self._Phase.EXITED
        return event

    def finish(self) -> None:
        if self._phase is not self._Phase.EXITED:
            raise ProtocolError("ExecStream ended without an exited event")


def shell_info_from_proto(shell: shell_pb.ShellInfo) -> ShellInfo:
    return ShellInfo(
        sandbox_id=shell.sandbox_id, name=shell.name, pid=shell.pid, turns=shell.turns, restarts=shell.restarts
    )


def find_shell(response: shell_pb.ListShellsResponse, name: str) -> ShellInfo | None:
    """The session called `name` in a ListShells reply, or None."""
    name = _shell_name(name)
    for shell in response.shells:
        if shell.name == name:
            return shell_info_from_proto(shell)
    return None


def shell_result_from_proto(response: shell_pb.RunInShellResponse) -> ShellResult:
    reason: ShellTimeoutReason | None = None
    if response.timed_out:
        # A reason this SDK does not know (a newer daemon) still says that a limit expired.
        reason = "idle_timeout" if response.timeout_reason == "idle_timeout" else "timeout"
    return ShellResult(
        output=response.output,
        exit_code=response.exit_code,
        timed_out=response.timed_out,
        timeout_reason=reason,
        truncated=response.truncated,
        output_total_bytes=response.output_total_bytes,
        duration_ms=response.duration_ms,
        shell_restarted=response.shell_restarted,
        output_plain=response.output_plain if response.HasField("output_plain") else None,
        stderr=response.stderr if response.HasField("stderr") else None,
        stderr_total_bytes=response.stderr_total_bytes,
        disk_cap_killed=response.disk_cap_killed,
    )


def kernel_info_from_proto(kernel: kernel_pb.KernelInfo) -> KernelInfo:
    return KernelInfo(
        sandbox_id=kernel.sandbox_id,
        id=kernel.kernel_id,
        state=cast(KernelState, enum_name(kernel_pb.KernelState, "KERNEL_STATE_", kernel.state)),
        execution_count=kernel.execution_count,
        python=kernel.python,
        restarts=kernel.restarts,
        auto_restart=kernel.auto_restart,
    )


def find_kernel(response: kernel_pb.ListKernelsResponse, kernel_id: str) -> KernelInfo | None:
    """The kernel `kernel_id` in a ListKernels reply, or None."""
    for kernel in response.kernels:
        if kernel.kernel_id == kernel_id:
            return kernel_info_from_proto(kernel)
    return None


def _kernel_error_fields(error: kernel_pb.KernelError) -> dict[str, Any]:
    """An error's fields, as the keyword arguments KernelErrorInfo and KernelErrorEvent share."""
    return {
        "ename": error.ename,
        "evalue": error.evalue,
        "traceback": list(error.traceback),
        "truncated": error.truncated,
        "total_bytes": error.total_bytes,
    }


def _kernel_error_info(error: kernel_pb.KernelError) -> KernelErrorInfo:
    return KernelErrorInfo(**_kernel_error_fields(error))


def kernel_late_output_from_proto(late: kernel_pb.KernelLateOutput) -> KernelLateOutput:
    return KernelLateOutput(
        stdout=late.stdout,
        stderr=late.stderr,
        displays=[dict(display.data) for display in late.displays],
        errors=[_kernel_error_info(error) for error in late.errors],
        truncated=late.truncated,
        stdout_total_bytes=late.stdout_total_bytes,
        stderr_total_bytes=late.stderr_total_bytes,
        dropped=late.dropped,
    )


def kernel_result_from_proto(response: kernel_pb.ExecuteGatheredResponse) -> KernelResult:
    if not response.HasField("done"):
        raise ProtocolError("ExecuteGathered answered without the cell's done event")
    error = response.error if response.HasField("error") else None
    done = response.done
    has_result = response.HasField("result")
    return KernelResult(
        stdout=response.stdout,
        stderr=response.stderr,
        result=dict(response.result.data) if has_result else None,
        displays=[dict(display.data) for display in response.displays],
        error=None if error is None else _kernel_error_info(error),
        **_cell_end_fields(done, truncated=response.truncated),
        result_truncated=has_result and response.result.truncated,
        result_total_bytes=response.result.total_bytes if has_result else 0,
        late_output=kernel_late_output_from_proto(response.late_output) if response.HasField("late_output") else None,
    )


def _cell_end_fields(done: kernel_pb.KernelDone, truncated: bool = False) -> dict[str, Any]:
    """How a cell ended, as the keyword arguments KernelResult and KernelDoneEvent share."""
    return {
        "execution_count": done.execution_count,
        "timed_out": done.timed_out,
        "kernel_died": done.kernel_died,
        "duration_ms": done.duration_ms,
        "truncated": truncated or done.truncated,
        "stdout_total_bytes": done.stdout_total_bytes,
        "stderr_total_bytes": done.stderr_total_bytes,
        "displays_dropped": done.displays_dropped,
        "exit_code": done.exit_code,
        "signal": done.signal,
        "oom_killed": done.oom_killed,
        "restarted": done.restarted,
        "restart_reason": done.restart_reason,
    }


def kernel_event_from_proto(response: kernel_pb.ExecuteResponse) -> KernelEvent:
    kind = response.WhichOneof("event")
    if kind == "stream":
        return KernelStreamEvent(name=_kernel_stream_name(response.stream.name), text=response.stream.text)
    if kind == "display":
        return KernelDisplayEvent(data=dict(response.display.data))
    if kind == "result":
        result = response.result
        return KernelResultEvent(data=dict(result.data), truncated=result.truncated, total_bytes=result.total_bytes)
    if kind == "error":
        return KernelErrorEvent(**_kernel_error_fields(response.error))
    if kind == "done":
        done = response.done
        return KernelDoneEvent(failed=done.failed, **_cell_end_fields(done))
    if kind == "late_output":
        return kernel_late_output_from_proto(response.late_output)
    raise ProtocolError("Execute sent an event with none of stream/display/result/error/done/late_output set")


class KernelEventDecoder:
    """Decodes one Execute stream's responses and enforces the order the contract fixes: at most
    one `late_output`, first; any number of stream/display/result/error events, then exactly one
    `done`, then nothing.

    One instance per stream; `finish()` is called when the stream ends by itself.
    """

    def __init__(self) -> None:
        self._done = False
        self._first = True

    def decode(self, response: kernel_pb.ExecuteResponse) -> KernelEvent:
        event = kernel_event_from_proto(response)
        if self._done:
            raise ProtocolError(f"Execute sent {type(event).__name__} after the done event")
        if isinstance(event, KernelLateOutput) and not self._first:
            raise ProtocolError("Execute sent late output after the cell's first event")
        self._first = False
        self._done = isinstance(event, KernelDoneEvent)
        return event

    def finish(self) -> None:
        if not self._done:
            raise ProtocolError("Execute ended without a done event")


# ---- helpers ---------------------------------------------------------------------------------


def _output_stream_name(number: int) -> OutputStreamName:
    if number == pb.OUTPUT_STREAM_STDOUT:
        return "stdout"
    if number == pb.OUTPUT_STREAM_STDERR:
        return "stderr"
    raise ProtocolError(f"ExecStream sent output for unknown stream {number}")


def _kernel_stream_name(number: int) -> OutputStreamName:
    if number == kernel_pb.STREAM_NAME_STDOUT:
        return "stdout"
    if number == kernel_pb.STREAM_NAME_STDERR:
        return "stderr"
    raise ProtocolError(f"Execute sent output for unknown stream {number}")


def _shell_name(name: str | None) -> str:
    if name is None:
        return DEFAULT_SHELL_NAME
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a shell name is a non-empty str, got {name!r}")
    return name


def _terminal_size(rows: int | None, cols: int | None) -> shell_pb.TerminalSize | None:
    """None when both are None (the daemon's default size); both must be given otherwise."""
    if rows is None and cols is None:
        return None
    if rows is None or cols is None:
        raise InvalidArgument(f"give both rows and cols, or neither; got rows={rows!r}, cols={cols!r}")
    if _non_negative("rows", rows) == 0 or _non_negative("cols", cols) == 0:
        raise InvalidArgument(f"rows and cols must be positive, got {rows}x{cols}")
    return shell_pb.TerminalSize(rows=rows, cols=cols)


def _cell_code(code: str) -> str:
    if not isinstance(code, str):
        raise InvalidArgument(f"cell code is str, got {type(code).__name__}")
    return code


def _datetime_from_ms(unix_ms: int) -> datetime:
    return datetime.fromtimestamp(unix_ms / 1000, tz=UTC)


def _timeout_ms(seconds: float | None) -> int:
    """A command, turn or cell timeout on the wire: None sends 0, the daemon's default."""
    return 0 if seconds is None else _positive_ms("timeout", seconds)


def _positive_ms(name: str, seconds: float) -> int:
    if seconds <= 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds, got {seconds}")
    # A tiny positive value must not round to 0, which means "the daemon's default".
    return max(1, round(seconds * 1000))


def _non_negative(name: str, value: int | None) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
    return value


def _user(user: str | None) -> str:
    """The wire value of a `user` argument: None is "" (the default user); the daemon checks the
    rest (a user name, a uid or uid:gid)."""
    if user is None:
        return ""
    if not isinstance(user, str):
        raise InvalidArgument(f"user must be a str (a user name, a uid or uid:gid), got {user!r}")
    return user


def _bind_mount(mount: MountSpec) -> pb.BindMount:
    """A Mount, or a (host_path, sandbox_path[, writable]) tuple, as the wire's BindMount."""
    if not isinstance(mount, Mount):
        if not isinstance(mount, tuple) or len(mount) not in (2, 3):
            raise InvalidArgument(f"a mount is a Mount or (host_path, sandbox_path[, writable]), got {mount!r}")
        mount = Mount(*mount)
    host, inside, writable = mount.host_path, mount.sandbox_path, mount.writable
    if not isinstance(host, str) or not isinstance(inside, str) or not isinstance(writable, bool):
        raise InvalidArgument(f"a mount's paths are str and `writable` a bool, got {mount!r}")
    return pb.BindMount(host_path=host, sandbox_path=inside, writable=writable)


def _string_map(name: str, mapping: Mapping[str, str] | None) -> dict[str, str]:
    if not mapping:
        return {}
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in mapping.items()):
        raise InvalidArgument(f"{name} keys and values must be str, got {dict(mapping)!r}")
    return dict(mapping)
