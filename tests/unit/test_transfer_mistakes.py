"""A caller's mistakes in file calls and transfers get definite status codes and change nothing:
the daemon's request handling above the backend, on the fake backend (a daemon in a thread of
this process, its sandboxes host directories). What a real sandbox's filesystem does with files
is the integration suite's (tests/integration/test_files.py, test_transfer_limits.py)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from corral.sdk import errors
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import sandbox_pb2_grpc
from tests.transfer_messages import tar_of, upload_messages


@pytest.fixture
def service(address) -> Iterator[sandbox_pb2_grpc.SandboxServiceStub]:
    with grpc.insecure_channel(address) as channel:
        yield sandbox_pb2_grpc.SandboxServiceStub(channel)


@pytest.mark.parametrize(
    ("call", "code"),
    [
        ("download missing", grpc.StatusCode.NOT_FOUND),
        ("download unknown sandbox", grpc.StatusCode.NOT_FOUND),
        ("download empty path", grpc.StatusCode.INVALID_ARGUMENT),
        ("upload into a file", grpc.StatusCode.INVALID_ARGUMENT),
        ("upload unknown sandbox", grpc.StatusCode.NOT_FOUND),
        ("upload without start", grpc.StatusCode.INVALID_ARGUMENT),
        ("upload nothing", grpc.StatusCode.INVALID_ARGUMENT),
        ("upload empty message", grpc.StatusCode.INVALID_ARGUMENT),
        ("read a directory", grpc.StatusCode.INVALID_ARGUMENT),
        ("write a directory", grpc.StatusCode.INVALID_ARGUMENT),
        ("write under a file", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_transfer_mistakes_get_definite_codes(service, sandbox, call, code):
    # (Paths relative to the workdir: on the fake backend an absolute path is the host's.)
    sandbox.write_file("plain.txt", b"x")
    sb = "sb-000000000000" if "unknown sandbox" in call else sandbox.id
    archive = tar_of({"a.txt": b"a"})
    with pytest.raises(grpc.RpcError) as err:
        if call.startswith("download"):
            path = {"download missing": "no/such/thing", "download empty path": ""}.get(call, ".")
            list(service.Download(pb.DownloadRequest(sandbox_id=sb, path=path), timeout=30))
        elif call == "upload without start":
            service.Upload(iter([pb.UploadRequest(chunk=archive)]), timeout=30)
        elif call == "upload nothing":
            service.Upload(iter([]), timeout=30)
        elif call == "upload empty message":
            service.Upload(upload_messages(sb, "u", then=[pb.UploadRequest()]), timeout=30)
        elif call.startswith("upload"):
            path = "plain.txt" if call == "upload into a file" else "u"
            service.Upload(upload_messages(sb, path, archive), timeout=30)
        elif call == "read a directory":
            service.ReadFile(pb.ReadFileRequest(sandbox_id=sb, path="."), timeout=30)
        else:
            path = "." if call == "write a directory" else "plain.txt/under"
            service.WriteFile(pb.WriteFileRequest(sandbox_id=sb, path=path, data=b"x", make_parents=True), timeout=30)
    assert err.value.code() == code, f"{call}: {err.value.code()} {err.value.details()}"
    assert sandbox.read_file("plain.txt") == b"x"
    # Nothing else arrived (an upload's destination directory itself stays: docs/files.md).
    assert {e.name for e in sandbox.list_dir(".")} <= {"plain.txt", "u"}
    assert "u" not in {e.name for e in sandbox.list_dir(".")} or sandbox.list_dir("u") == []


@pytest.mark.parametrize("method", ["ReadFile", "Download", "Upload"])
def test_a_path_that_is_not_utf8_is_invalid_argument(address, sandbox, method):
    """proto strings must be UTF-8: a request whose path is not used to fail inside grpc's
    deserializer as UNKNOWN."""
    path = b"caf\xe9"
    # Field 1 sandbox_id, field 2 path, both length-delimited: the same bytes ReadFileRequest,
    # DownloadRequest and UploadStart would have, with a path no str can hold.
    fields = b"\x0a" + bytes([len(sandbox.id)]) + sandbox.id.encode() + b"\x12" + bytes([len(path)]) + path
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        name = f"/corral.v1.SandboxService/{method}"
        if method == "ReadFile":
            channel.unary_unary(name)(fields, timeout=10)
        elif method == "Download":
            list(channel.unary_stream(name)(fields, timeout=10))
        else:  # UploadRequest.start is field 1
            start = b"\x0a" + bytes([len(fields)]) + fields
            channel.stream_unary(name)(iter([start]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "UTF-8" in err.value.details()


def test_upload_rejects_a_bad_message_after_the_archive(service, sandbox):
    messages = upload_messages(
        sandbox.id,
        "up",
        tar_of({"a.txt": b"hi"}),
        then=[pb.UploadRequest(start=pb.UploadStart(sandbox_id=sandbox.id, path="elsewhere"))],
    )
    with pytest.raises(grpc.RpcError) as err:
        service.Upload(messages, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sandbox.list_dir("up") == []  # (the destination itself stays: docs/files.md)


def test_a_huge_offset_is_invalid_and_a_missing_file_not_found(sandbox):
    sandbox.write_file("small.txt", b"x")
    with pytest.raises(errors.InvalidArgument):
        sandbox.read_file("small.txt", offset=2**63, limit=1)
    with pytest.raises(errors.SandboxNotFound):
        sandbox.read_file("does/not/exist")
