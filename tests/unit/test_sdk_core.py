"""Unit tests of the SDK's sans-IO parts: addresses, request building, decoding, the error map."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, get_args

import grpc
import pytest

from corral.sdk import _core
from corral.sdk import types as sdk_types
from corral.sdk._address import (
    DEFAULT_ADDRESS,
    DaemonAddress,
    auth_metadata,
    channel_options,
    parse_address,
    resolve_address,
    resolve_token,
)
from corral.sdk.enums import backend_number, enum_name
from corral.sdk.errors import (
    AlreadyExists,
    Cancelled,
    CommandExitError,
    CorralError,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    RpcErrorTranslator,
    SandboxNotFound,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    error_class_for,
    error_from_rpc,
)
from corral.sdk.rollout_messages import llm_protocol_name
from corral.sdk.types import ExecExited, ExecKeepalive, ExecOutput, ExecResult, ExecStarted
from corral.v1 import kernel_pb2 as kernel_pb
from corral.v1 import rollout_pb2 as rollout_pb
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import shell_pb2 as shell_pb

# ---- addresses -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "transport", "target", "shown"),
    [
        ("unix:///run/corral/corral.sock", "unix", "unix:///run/corral/corral.sock", "unix:///run/corral/corral.sock"),
        ("/tmp/c.sock", "unix", "unix:///tmp/c.sock", "unix:///tmp/c.sock"),
        ("unix:/tmp/c.sock", "unix", "unix:///tmp/c.sock", "unix:///tmp/c.sock"),
        ("unix:rel/c.sock", "unix", "unix:rel/c.sock", "unix:rel/c.sock"),
        ("./c.sock", "unix", "unix:./c.sock", "unix:./c.sock"),
        ("localhost:50051", "tcp", "localhost:50051", "tcp://localhost:50051"),
        ("tcp://10.0.0.7:7000", "tcp", "10.0.0.7:7000", "tcp://10.0.0.7:7000"),
        ("tcp://node-3:7000/", "tcp", "node-3:7000", "tcp://node-3:7000"),
        ("[::1]:7000", "tcp", "[::1]:7000", "tcp://[::1]:7000"),
        ("  host:1  ", "tcp", "host:1", "tcp://host:1"),
    ],
)
def test_parse_address(text: str, transport: str, target: str, shown: str) -> None:
    address = parse_address(text)
    assert address.transport == transport
    assert address.grpc_target == target
    assert str(address) == shown


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "unix://",
        "host",
        "host:",
        "host:port",
        "host:0",
        "host:70000",
        "tcp://host",
        "http://host:80",
        "::1:7000",
        ":7000",
    ],
)
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_address(text)


def test_resolve_address_precedence() -> None:
    assert str(resolve_address(None, {})) == DEFAULT_ADDRESS == "unix:///run/corral/corral.sock"
    assert resolve_address(None, {"CORRAL_SOCKET": "/s.sock"}) == DaemonAddress("unix", "/s.sock")
    both = {"CORRAL_SOCKET": "/s.sock", "CORRAL_ADDRESS": "h:1"}
    assert resolve_address(None, both) == DaemonAddress("tcp", "h:1")
    assert resolve_address("/explicit.sock", both) == DaemonAddress("unix", "/explicit.sock")
    assert str(resolve_address(None, {"CORRAL_ADDRESS": "", "CORRAL_SOCKET": ""})) == DEFAULT_ADDRESS


def test_token_and_metadata() -> None:
    assert resolve_token(None, {}) is None
    assert resolve_token(None, {"CORRAL_TOKEN": "t0"}) == "t0"
    assert resolve_token("t1", {"CORRAL_TOKEN": "t0"}) == "t1"
    assert auth_metadata(None) == ()
    assert auth_metadata("s3cret") == (("authorization", "Bearer s3cret"),)


def test_channel_options_lift_message_caps() -> None:
    options = dict(channel_options())
    assert options["grpc.max_receive_message_length"] == -1
    assert options["grpc.max_send_message_length"] == -1


# ---- requests --------------------------------------------------------------------------------

EXEC_DEFAULTS: dict[str, Any] = dict(stdin=None, env=None, cwd=None, timeout=10, output_limit=None)


def test_exec_request_argv() -> None:
    request = _core.build_exec_request("sb-1", ["echo", "hi"], **EXEC_DEFAULTS)
    assert request.sandbox_id == "sb-1"
    command = request.command
    assert command.WhichOneof("program") == "argv"
    assert list(command.argv.args) == ["echo", "hi"]
    assert not command.HasField("stdin")
    assert command.timeout_ms == 10_000
    assert command.output_limit_bytes == 0
    assert command.cwd == ""


def test_exec_request_shell_with_options() -> None:
    request = _core.build_exec_request(
        "sb-1", "echo $X | wc -c", stdin="héllo", env={"X": "1"}, cwd="/tmp", timeout=0.25, output_limit=4096
    )
    command = request.command
    assert command.WhichOneof("program") == "shell"
    assert command.shell == "echo $X | wc -c"
    assert command.stdin == "héllo".encode()
    assert dict(command.env) == {"X": "1"}
    assert command.cwd == "/tmp"
    assert command.timeout_ms == 250
    assert command.output_limit_bytes == 4096


def test_exec_request_empty_stdin_is_set() -> None:
    """b"" still feeds stdin (then EOF); only None leaves the optional field unset."""
    command = _core.build_exec_request("sb", ["cat"], **{**EXEC_DEFAULTS, "stdin": b""}).command
    assert command.HasField("stdin")
    assert command.stdin == b""


def test_exec_request_tuple_argv() -> None:
    command = _core.build_exec_request("sb", ("ls", "-l"), **EXEC_DEFAULTS).command
    assert list(command.argv.args) == ["ls", "-l"]


@pytest.mark.parametrize(
    ("cmd", "overrides"),
    [
        ([], {}),
        ("  ", {}),
        (["echo", 1], {}),
        (b"echo", {}),
        (["true"], {"timeout": 0}),
        (["true"], {"timeout": -1}),
        (["true"], {"output_limit": -5}),
        (["true"], {"env": {"A": 1}}),
    ],
)
def test_exec_request_rejects(cmd: Any, overrides: dict) -> None:
    with pytest.raises(InvalidArgument):
        _core.build_exec_request("sb", cmd, **{**EXEC_DEFAULTS, **overrides})


def test_tiny_timeout_never_becomes_zero() -> None:
    """0 ms would mean "the daemon's default", far longer than asked."""
    assert _core.build_exec_request("sb", ["true"], **{**EXEC_DEFAULTS, "timeout": 0.0001}).command.timeout_ms == 1


def test_exec_stream_request_keepalive() -> None:
    request = _core.build_exec_stream_request("sb", ["sleep", "5"], **EXEC_DEFAULTS, keepalive=1.5)
    assert request.keepalive_interval_ms == 1500
    assert list(request.command.argv.args) == ["sleep", "5"]
    none = _core.build_exec_stream_request("sb", ["true"], **EXEC_DEFAULTS, keepalive=None)
    assert none.keepalive_interval_ms == 0


def test_deadlines() -> None:
    assert _core.exec_deadline(60) == 60 + _core.EXEC_DEADLINE_MARGIN_S
    assert _core.call_deadline(None, 30.0) == 30.0
    assert _core.call_deadline(5, 30.0) == 5
    with pytest.raises(InvalidArgument):
        _core.call_deadline(0, 30.0)
    with pytest.raises(InvalidArgument):
        _core.call_deadline(None, -1)


def test_create_sandbox_request() -> None:
    request = _core.build_create_sandbox_request(
        image="python:3.12",
        backend="docker",
        memory_bytes=512 << 20,
        pids=256,
        cpu_millicores=1500,
        disk_bytes=2 << 30,
        network=True,
        env={"A": "b"},
        labels={"job": "7"},
        idle_timeout=90,
    )
    assert request.backend == pb.BACKEND_DOCKER
    assert request.image == "python:3.12"
    assert request.limits == pb.ResourceLimits(
        memory_bytes=512 << 20, pids=256, cpu_millicores=1500, disk_bytes=2 << 30
    )
    assert request.network is True
    assert dict(request.env) == {"A": "b"}
    assert dict(request.labels) == {"job": "7"}
    assert request.idle_timeout_ms == 90_000


def _create_request(**options: Any) -> pb.CreateSandboxRequest:
    """A CreateSandboxRequest with every option the SDK's default but those given."""
    defaults: dict[str, Any] = dict(
        image=None,
        backend=None,
        memory_bytes=None,
        pids=None,
        cpu_millicores=None,
        disk_bytes=None,
        network=False,
        env=None,
        labels=None,
        idle_timeout=None,
    )
    return _core.build_create_sandbox_request(**{**defaults, **options})


def test_create_sandbox_request_defaults() -> None:
    request = _create_request(image="host")
    assert request.backend == pb.BACKEND_UNSPECIFIED
    assert request.limits == pb.ResourceLimits()
    assert request.idle_timeout_ms == 0


def test_create_sandbox_request_user_and_mounts() -> None:
    request = _create_request(
        user="1000:1000",
        mounts=[sdk_types.Mount("/data/a", "/a"), ("/data/b", "/b"), ("/data/c", "/c", True)],
    )
    assert request.user == "1000:1000"
    assert list(request.mounts) == [
        pb.BindMount(host_path="/data/a", sandbox_path="/a", writable=False),
        pb.BindMount(host_path="/data/b", sandbox_path="/b", writable=False),
        pb.BindMount(host_path="/data/c", sandbox_path="/c", writable=True),
    ]
    assert _create_request().user == "" and not _create_request().mounts


@pytest.mark.parametrize(
    "options",
    [
        {"user": 1000},
        {"mounts": ["/data:/data"]},
        {"mounts": [("/data",)]},
        {"mounts": [("/data", "/data", "rw")]},
        {"mounts": [sdk_types.Mount("/data", 5)]},  # type: ignore[arg-type]
    ],
)
def test_create_sandbox_request_bad_user_or_mounts(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        _create_request(**options)


def test_user_on_exec_shell_attach_and_kernel_requests() -> None:
    options: dict[str, Any] = dict(stdin=None, env=None, cwd=None, timeout=None, output_limit=None)
    assert _core.build_exec_request("sb", ["id"], **options, user="root").command.user == "root"
    assert _core.build_exec_request("sb", ["id"], **options).command.user == ""
    stream = _core.build_exec_stream_request("sb", "id", **options, keepalive=None, user="7")
    assert stream.command.user == "7"
    shell = _core.build_open_shell_request(
        "sb", "main", env=None, cwd=None, rows=None, cols=None, program=None, user="a"
    )
    assert shell.user == "a"
    attach = _core.build_attach_start("sb", rows=None, cols=None, term=None, program=None, user="0:0")
    assert attach.start.user == "0:0"
    assert _core.build_start_kernel_request("sb", python=None, cwd=None, env=None, user="b").user == "b"
    with pytest.raises(InvalidArgument, match="user must be a str"):
        _core.build_exec_request("sb", ["id"], **options, user=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "number"),
    [
        (None, pb.BACKEND_UNSPECIFIED),
        ("local", pb.BACKEND_LOCAL),
        ("docker", pb.BACKEND_DOCKER),
        ("singularity", pb.BACKEND_SINGULARITY),
    ],
)
def test_backend_names(name: str | None, number: int) -> None:
    assert backend_number(name) == number


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="podman"):
        backend_number("podman")


def test_write_file_request() -> None:
    request = _core.build_write_file_request("sb", "a/b.txt", "ü", mode=0o600, make_parents=True)
    assert request.data == "ü".encode()
    assert request.mode == 0o600
    assert request.make_parents is True
    assert _core.build_write_file_request("sb", "x", b"\x00", mode=None, make_parents=False).mode == 0


def test_upload_requests_start_first() -> None:
    requests = list(_core.upload_requests("sb", "/workspace", [b"one", b"two"]))
    assert [r.WhichOneof("message") for r in requests] == ["start", "chunk", "chunk"]
    assert requests[0].start == pb.UploadStart(sandbox_id="sb", path="/workspace")
    assert [r.chunk for r in requests[1:]] == [b"one", b"two"]


def test_list_sandboxes_request() -> None:
    assert dict(_core.build_list_sandboxes_request({"a": "1"}).labels) == {"a": "1"}
    assert dict(_core.build_list_sandboxes_request(None).labels) == {}


# ---- the ReadFile plan -----------------------------------------------------------------------


def drive(plan, file: bytes, cap: int) -> tuple[bytes, list[pb.ReadFileRequest]]:
    """Runs a read plan against an in-memory file served with a per-reply cap."""
    sent: list[pb.ReadFileRequest] = []
    try:
        request = next(plan)
        while True:
            sent.append(request)
            size = cap if request.limit_bytes == 0 else min(cap, request.limit_bytes)
            data = file[request.offset : request.offset + size]
            reply = pb.ReadFileResponse(
                data=data, size_bytes=len(file), truncated=request.offset + len(data) < len(file)
            )
            request = plan.send(reply)
    except StopIteration as finished:
        return finished.value, sent


FILE = bytes(range(256)) * 40  # 10240 bytes


def test_read_whole_file_in_several_replies() -> None:
    data, sent = drive(_core.read_file_plan("sb", "f", offset=0, limit=None), FILE, cap=4096)
    assert data == FILE
    assert [r.offset for r in sent] == [0, 4096, 8192]
    assert all(r.limit_bytes == 0 for r in sent)


def test_read_range() -> None:
    data, sent = drive(_core.read_file_plan("sb", "f", offset=100, limit=5000), FILE, cap=4096)
    assert data == FILE[100:5100]
    assert [(r.offset, r.limit_bytes) for r in sent] == [(100, 5000), (4196, 904)]


def test_read_small_file_is_one_call() -> None:
    data, sent = drive(_core.read_file_plan("sb", "f", offset=0, limit=None), b"hello", cap=4096)
    assert data == b"hello"
    assert len(sent) == 1


def test_read_zero_bytes_makes_no_call() -> None:
    data, sent = drive(_core.read_file_plan("sb", "f", offset=0, limit=0), FILE, cap=4096)
    assert (data, sent) == (b"", [])


def test_read_plan_rejects_a_reply_without_progress() -> None:
    plan = _core.read_file_plan("sb", "f", offset=0, limit=None)
    next(plan)
    with pytest.raises(ProtocolError):
        plan.send(pb.ReadFileResponse(data=b"", size_bytes=10, truncated=True))


@pytest.mark.parametrize("limit", [None, _core.READ_FILE_MAX_BYTES + 1])
def test_read_past_the_limit_fails_after_one_reply(limit) -> None:
    """The first reply tells the size: a read that would return more than READ_FILE_MAX_BYTES
    stops there instead of gathering the file in memory."""
    plan = _core.read_file_plan("sb", "f", offset=10, limit=limit)
    next(plan)
    huge = _core.READ_FILE_MAX_BYTES + 100
    total = huge - 10 if limit is None else limit
    with pytest.raises(FailedPrecondition, match=rf"{total} bytes.*download"):
        plan.send(pb.ReadFileResponse(data=b"x" * 4096, size_bytes=huge, truncated=True))


def test_a_range_of_a_huge_file_is_fine() -> None:
    plan = _core.read_file_plan("sb", "f", offset=1 << 40, limit=3)
    next(plan)
    with pytest.raises(StopIteration) as done:
        plan.send(pb.ReadFileResponse(data=b"abc", size_bytes=1 << 41, truncated=True))
    assert done.value.value == b"abc"


def test_read_plan_rejects_negative_offset() -> None:
    with pytest.raises(InvalidArgument):
        next(_core.read_file_plan("sb", "f", offset=-1, limit=None))


# ---- decoders --------------------------------------------------------------------------------


def sandbox_message() -> pb.Sandbox:
    return pb.Sandbox(
        sandbox_id="sb-3f9c2a61d0e4",
        backend=pb.BACKEND_LOCAL,
        image="host",
        state=pb.SANDBOX_STATE_RUNNING,
        isolation=pb.ISOLATION_LEVEL_NAMESPACES,
        limits=pb.ResourceLimits(memory_bytes=1 << 30, pids=512, cpu_millicores=2000),
        limit_status=[
            pb.LimitStatus(kind=pb.LIMIT_KIND_MEMORY, enforced=True, mechanism="cgroup v1 memory"),
            pb.LimitStatus(kind=pb.LIMIT_KIND_CPU, enforced=False, reason="no cpu controller"),
        ],
        network=False,
        labels={"job": "7"},
        created_at_unix_ms=1_700_000_000_123,
        workdir="/workspace",
        idle_timeout_ms=600_000,
    )


def test_sandbox_info_from_proto() -> None:
    info = _core.sandbox_info_from_proto(sandbox_message())
    assert info.id == "sb-3f9c2a61d0e4"
    assert info.backend == "local"
    assert info.state == "running"
    assert info.isolation == "namespaces"
    assert info.limits.memory_bytes == 1 << 30 and info.limits.pids == 512 and info.limits.cpu_millicores == 2000
    assert [(s.kind, s.enforced, s.mechanism, s.reason) for s in info.limit_status] == [
        ("memory", True, "cgroup v1 memory", ""),
        ("cpu", False, "", "no cpu controller"),
    ]
    assert info.labels == {"job": "7"}
    assert info.workdir == "/workspace"
    assert info.created_at == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    assert info.idle_timeout == 600.0
    assert info.user == "" and info.mounts == ()


def test_sandbox_info_user_and_mounts_from_proto() -> None:
    message = sandbox_message()
    message.user = "agent"
    message.mounts.add(host_path="/data/a", sandbox_path="/a", writable=True)
    message.mounts.add(host_path="/data/b", sandbox_path="/b")
    info = _core.sandbox_info_from_proto(message)
    assert info.user == "agent"
    assert info.mounts == (sdk_types.Mount("/data/a", "/a", True), sdk_types.Mount("/data/b", "/b", False))


def test_unknown_enum_value_reads_as_unknown() -> None:
    message = sandbox_message()
    message.state = 99  # type: ignore[assignment]  # a state added by a newer daemon, outside the stub's enum
    message.idle_timeout_ms = 0
    info = _core.sandbox_info_from_proto(message)
    assert info.state == "unknown"
    assert info.idle_timeout is None


@pytest.mark.parametrize(
    ("literal", "enum_type", "prefix"),
    [
        (sdk_types.SandboxState, pb.SandboxState, "SANDBOX_STATE_"),
        (sdk_types.IsolationLevel, pb.IsolationLevel, "ISOLATION_LEVEL_"),
        (sdk_types.LimitKind, pb.LimitKind, "LIMIT_KIND_"),
        (sdk_types.FileType, pb.FileType, "FILE_TYPE_"),
        (sdk_types.KernelState, kernel_pb.KernelState, "KERNEL_STATE_"),
        (sdk_types.RolloutStatus, rollout_pb.RolloutStatus, "ROLLOUT_STATUS_"),
        (sdk_types.FilterReason, rollout_pb.FilterReason, "FILTER_REASON_"),
        (sdk_types.FinishReason, rollout_pb.FinishReason, "FINISH_REASON_"),
        (sdk_types.EvalSandbox, rollout_pb.EvalSandbox, "EVAL_SANDBOX_"),
    ],
)
def test_enum_literals_name_every_contract_value(literal: Any, enum_type: Any, prefix: str) -> None:
    """The decoders cast enum_name's answer to these Literal types: each lists every name it gives."""
    names = {enum_name(enum_type, prefix, number) for number in enum_type.values()} | {"unknown"}
    assert set(get_args(literal)) == names


def test_exec_result_from_proto() -> None:
    response = pb.ExecResponse(
        status=pb.ExitStatus(exit_code=137, signal=9, timed_out=True, oom_killed=False, duration_ms=1003),
        stdout=b"partial\xff",
        stderr=b"",
        truncated=True,
        stdout_total_bytes=5 << 20,
        stderr_total_bytes=0,
    )
    result = _core.exec_result_from_proto(response)
    assert result == ExecResult(
        exit_code=137,
        signal=9,
        stdout=b"partial\xff",
        stderr=b"",
        timed_out=True,
        oom_killed=False,
        truncated=True,
        duration_ms=1003,
        stdout_total_bytes=5 << 20,
        stderr_total_bytes=0,
    )
    assert result.text == "partial\ufffd"
    assert not result.ok


def test_a_command_killed_for_the_disk_cap_says_so() -> None:
    status = pb.ExitStatus(exit_code=137, signal=9, disk_cap_killed=True)
    assert _core.exec_result_from_proto(pb.ExecResponse(status=status)).disk_cap_killed
    exited = _core.exec_event_from_proto(pb.ExecStreamResponse(exited=pb.ExecExited(status=status)))
    assert isinstance(exited, ExecExited) and exited.disk_cap_killed
    turn = _core.shell_result_from_proto(shell_pb.RunInShellResponse(exit_code=137, disk_cap_killed=True))
    assert turn.disk_cap_killed
    with pytest.raises(CommandExitError, match="past its disk cap"):
        turn.check()


def make_result(**fields: Any) -> ExecResult:
    defaults: dict[str, Any] = dict(
        exit_code=0,
        signal=0,
        stdout=b"",
        stderr=b"",
        timed_out=False,
        oom_killed=False,
        truncated=False,
        duration_ms=1,
        stdout_total_bytes=0,
        stderr_total_bytes=0,
    )
    return ExecResult(**{**defaults, **fields})


def test_check_passes_ok_results() -> None:
    result = make_result(stdout=b"hi\n")
    assert result.ok
    assert result.check() is result


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"exit_code": 2, "stderr": b"ls: cannot access 'x'\n"}, "exited with code 2; stderr: ls: cannot access 'x'"),
        ({"exit_code": 137, "signal": 9, "timed_out": True, "duration_ms": 5000}, "timed out after 5000 ms"),
        ({"exit_code": 137, "signal": 9}, "killed by signal 9"),
        ({"exit_code": 137, "signal": 9, "oom_killed": True}, "out-of-memory"),
        ({"exit_code": 137, "signal": 9, "disk_cap_killed": True}, "past its disk cap"),
    ],
)
def test_check_raises_with_the_result(fields: dict, phrase: str) -> None:
    result = make_result(**fields)
    with pytest.raises(CommandExitError, match=phrase) as caught:
        result.check()
    assert caught.value.result is result
    assert caught.value.code is None
    assert isinstance(caught.value, CorralError)


def stream_events() -> list[pb.ExecStreamResponse]:
    return [
        pb.ExecStreamResponse(started=pb.ExecStarted(pid=4242)),
        pb.ExecStreamResponse(output=pb.ExecOutput(stream=pb.OUTPUT_STREAM_STDOUT, data=b"out")),
        pb.ExecStreamResponse(keepalive=pb.ExecKeepalive()),
        pb.ExecStreamResponse(output=pb.ExecOutput(stream=pb.OUTPUT_STREAM_STDERR, data=b"err")),
        pb.ExecStreamResponse(
            exited=pb.ExecExited(
                status=pb.ExitStatus(exit_code=3, duration_ms=12),
                truncated=False,
                stdout_total_bytes=3,
                stderr_total_bytes=3,
            )
        ),
    ]


def test_exec_event_decoder_in_order() -> None:
    decoder = _core.ExecEventDecoder()
    events = [decoder.decode(response) for response in stream_events()]
    decoder.finish()
    assert events == [
        ExecStarted(pid=4242),
        ExecOutput(stream="stdout", data=b"out"),
        ExecKeepalive(),
        ExecOutput(stream="stderr", data=b"err"),
        ExecExited(
            exit_code=3,
            signal=0,
            timed_out=False,
            oom_killed=False,
            truncated=False,
            duration_ms=12,
            stdout_total_bytes=3,
            stderr_total_bytes=3,
        ),
    ]


@pytest.mark.parametrize(
    ("order", "problem"),
    [
        ([1], "before the started event"),
        ([0, 0], "second started"),
        ([0, 4, 1], "after the exited event"),
    ],
)
def test_exec_event_decoder_rejects_bad_order(order: list[int], problem: str) -> None:
    responses = stream_events()
    decoder = _core.ExecEventDecoder()
    with pytest.raises(ProtocolError, match=problem):
        for index in order:
            decoder.decode(responses[index])


def test_exec_event_decoder_needs_exited() -> None:
    decoder = _core.ExecEventDecoder()
    decoder.decode(stream_events()[0])
    with pytest.raises(ProtocolError, match="without an exited event"):
        decoder.finish()


def test_exec_event_decoder_rejects_empty_event() -> None:
    with pytest.raises(ProtocolError):
        _core.ExecEventDecoder().decode(pb.ExecStreamResponse())


def test_file_entry_from_proto() -> None:
    link = _core.file_entry_from_proto(
        pb.FileInfo(
            name="python",
            path="/usr/bin/python",
            type=pb.FILE_TYPE_SYMLINK,
            size_bytes=9,
            mode=0o777,
            modified_unix_ms=0,
            symlink_target="python3",
        )
    )
    assert (link.name, link.type, link.symlink_target, link.mode) == ("python", "symlink", "python3", 0o777)
    assert link.modified_at == datetime(1970, 1, 1, tzinfo=UTC)
    directory = _core.file_entry_from_proto(pb.FileInfo(name="d", path="/d", type=pb.FILE_TYPE_DIRECTORY))
    assert directory.is_dir and not directory.is_file and directory.symlink_target is None


def test_node_info_from_proto() -> None:
    info = _core.node_info_from_proto(
        pb.GetNodeInfoResponse(
            version="0.1.0",
            daemon_id="d-1",
            default_backend=pb.BACKEND_LOCAL,
            cgroup_mode="hybrid",
            sandbox_count=3,
            backends=[
                pb.BackendInfo(
                    backend=pb.BACKEND_LOCAL,
                    available=True,
                    detail="bubblewrap 0.8.0",
                    isolation=pb.ISOLATION_LEVEL_NAMESPACES,
                    limits=[pb.LimitStatus(kind=pb.LIMIT_KIND_PIDS, enforced=True, mechanism="cgroup v1 pids")],
                ),
                pb.BackendInfo(backend=pb.BACKEND_DOCKER, available=False, detail="no docker socket"),
            ],
        )
    )
    assert (info.version, info.daemon_id, info.default_backend, info.cgroup_mode, info.sandbox_count) == (
        "0.1.0",
        "d-1",
        "local",
        "hybrid",
        3,
    )
    local, docker = info.backends
    assert (local.backend, local.available, local.isolation, local.limits[0].kind) == (
        "local",
        True,
        "namespaces",
        "pids",
    )
    assert (docker.backend, docker.available, docker.detail, docker.isolation) == (
        "docker",
        False,
        "no docker socket",
        "unspecified",
    )


# ---- errors ----------------------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    """What the sync channel raises: an RpcError that is also a Call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def aio_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


ERROR_MAP = [
    (grpc.StatusCode.NOT_FOUND, NotFound),
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
    (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
    (grpc.StatusCode.ALREADY_EXISTS, AlreadyExists),
    (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
    (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.CANCELLED, Cancelled),
    (grpc.StatusCode.INTERNAL, Internal),
    (grpc.StatusCode.UNIMPLEMENTED, Unimplemented),
]


@pytest.mark.parametrize(("code", "error_class"), ERROR_MAP, ids=[code.name for code, _ in ERROR_MAP])
@pytest.mark.parametrize("make_error", [FakeRpcError, aio_error], ids=["sync", "aio"])
def test_error_map(code: grpc.StatusCode, error_class: type[CorralError], make_error) -> None:
    error = error_from_rpc(make_error(code, "what to fix"), address="unix:///s.sock")
    assert type(error) is error_class
    assert isinstance(error, CorralError)
    assert error.code == code == error_class.code
    assert error.details == "what to fix"
    assert error_class_for(code) is error_class


def test_sandbox_not_found_is_not_found() -> None:
    assert SandboxNotFound is NotFound


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OUT_OF_RANGE]
)
def test_unmapped_codes_become_the_root_class(code: grpc.StatusCode) -> None:
    error = error_from_rpc(FakeRpcError(code, "odd"), address="unix:///s.sock")
    assert type(error) is CorralError
    assert error.code == code
    assert code.name in str(error)


def test_bare_rpc_error_has_a_code() -> None:
    error = error_from_rpc(grpc.RpcError("?"), address="unix:///s.sock")
    assert type(error) is CorralError
    assert error.code == grpc.StatusCode.UNKNOWN


def test_unavailable_names_the_address() -> None:
    error = error_from_rpc(
        aio_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"),
        address="unix:///run/corral/corral.sock",
    )
    assert isinstance(error, Unavailable)
    assert "unix:///run/corral/corral.sock" in str(error)
    assert "failed to connect to all addresses" in str(error)
    assert error.address == "unix:///run/corral/corral.sock"


def test_translator_raises_from_the_rpc_error() -> None:
    original = FakeRpcError(grpc.StatusCode.NOT_FOUND, "no sandbox sb-x")
    with pytest.raises(NotFound) as caught, RpcErrorTranslator("unix:///s.sock"):
        raise original
    assert caught.value.__cause__ is original
    assert str(caught.value) == "no sandbox sb-x"


@pytest.mark.parametrize("passing", [asyncio.CancelledError(), KeyError("k"), ProtocolError("p")])
def test_translator_lets_other_exceptions_through(passing: BaseException) -> None:
    with pytest.raises(type(passing)) as caught, RpcErrorTranslator("unix:///s.sock"):
        raise passing
    assert caught.value is passing


def test_errors_are_corral_errors() -> None:
    for _, error_class in ERROR_MAP:
        assert issubclass(error_class, CorralError)
    for local_class in (CommandExitError, ProtocolError):
        assert issubclass(local_class, CorralError)


def test_llm_protocol_names() -> None:
    """LLM_PROTOCOL_UNSPECIFIED means SGLang (rollout.proto), as the daemon reads it."""
    assert llm_protocol_name(rollout_pb.LLM_PROTOCOL_UNSPECIFIED) == "sglang"
    assert llm_protocol_name(rollout_pb.LLM_PROTOCOL_SGLANG) == "sglang"
    assert llm_protocol_name(rollout_pb.LLM_PROTOCOL_VLLM) == "vllm"
    assert llm_protocol_name(99) == "unknown"
