"""Both clients against an in-process FAKE SandboxService (a stand-in, not the daemon).

The fake exists for what a correct daemon never does on purpose: events out of order, a stream
without `exited`, unsafe archives, exact deadlines and injected status codes. Everything a real
daemon can show is tested against one in test_exec.py, test_files.py and test_daemon.py."""

from __future__ import annotations

import asyncio
import io
import tarfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from corral.sdk import (
    AsyncClient,
    AsyncSandbox,
    Client,
    CommandExitError,
    ExecExited,
    ExecKeepalive,
    ExecOutput,
    ExecStarted,
    FailedPrecondition,
    InvalidArgument,
    SandboxNotFound,
    Unauthenticated,
    Unavailable,
)
from corral.sdk._core import EXEC_DEADLINE_MARGIN_S
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import sandbox_pb2_grpc

READ_CAP = 4  # bytes per ReadFile reply, so that reads need several calls


class FakeSandboxService(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.sandboxes: dict[str, pb.Sandbox] = {}
        self.files: dict[str, bytes] = {}
        self.archives: dict[str, bytes] = {}
        self.deadlines: list[float] = []
        self.commands: list[pb.Command] = []
        self.stream_cancelled = threading.Event()
        self.upload_started = threading.Event()
        self.upload_ended = threading.Event()
        self._lock = threading.Lock()

    def _check(self, context: grpc.ServicerContext) -> None:
        if self.token and dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        self.deadlines.append(context.time_remaining())

    def _sandbox(self, sandbox_id: str, context: grpc.ServicerContext) -> pb.Sandbox:
        if sandbox_id not in self.sandboxes:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {sandbox_id}")
        return self.sandboxes[sandbox_id]

    def CreateSandbox(self, request, context):
        self._check(context)
        with self._lock:
            sandbox_id = f"sb-{len(self.sandboxes) + 1:012x}"
        sandbox = pb.Sandbox(
            sandbox_id=sandbox_id,
            backend=request.backend or pb.BACKEND_LOCAL,
            image=request.image or "host",
            state=pb.SANDBOX_STATE_RUNNING,
            labels=request.labels,
            workdir="/workspace",
            limits=request.limits,
            created_at_unix_ms=int(time.time() * 1000),
        )
        self.sandboxes[sandbox_id] = sandbox
        return pb.CreateSandboxResponse(sandbox=sandbox)

    def GetSandbox(self, request, context):
        self._check(context)
        return pb.GetSandboxResponse(sandbox=self._sandbox(request.sandbox_id, context))

    def ListSandboxes(self, request, context):
        self._check(context)
        wanted = dict(request.labels).items()
        return pb.ListSandboxesResponse(
            sandboxes=[sandbox for sandbox in self.sandboxes.values() if wanted <= dict(sandbox.labels).items()]
        )

    def DestroySandbox(self, request, context):
        self._check(context)
        self._sandbox(request.sandbox_id, context)
        del self.sandboxes[request.sandbox_id]
        return pb.DestroySandboxResponse()

    def Exec(self, request, context):
        self._check(context)
        self._sandbox(request.sandbox_id, context)
        command = request.command
        self.commands.append(command)
        if command.WhichOneof("program") == "shell":
            return pb.ExecResponse(status=pb.ExitStatus(), stdout=command.shell.encode())
        args = list(command.argv.args)
        if args[0] == "echo":
            return pb.ExecResponse(status=pb.ExitStatus(duration_ms=1), stdout=(" ".join(args[1:]) + "\n").encode())
        if args[0] == "cat":
            return pb.ExecResponse(status=pb.ExitStatus(), stdout=command.stdin)
        if args[0] == "sleep":
            while context.is_active():
                time.sleep(0.01)
            return pb.ExecResponse()
        return pb.ExecResponse(status=pb.ExitStatus(exit_code=1), stderr=b"nope\n")

    def ExecStream(self, request, context):
        self._check(context)
        yield pb.ExecStreamResponse(started=pb.ExecStarted(pid=77))
        if list(request.command.argv.args) == ["sleep"]:
            # Runs until the client cancels the call (its deadline is far away), which ends the RPC.
            context.add_callback(self.stream_cancelled.set)
            while context.is_active():
                yield pb.ExecStreamResponse(keepalive=pb.ExecKeepalive())
                time.sleep(0.01)
            return
        yield pb.ExecStreamResponse(output=pb.ExecOutput(stream=pb.OUTPUT_STREAM_STDOUT, data=b"a"))
        yield pb.ExecStreamResponse(output=pb.ExecOutput(stream=pb.OUTPUT_STREAM_STDERR, data=b"b"))
        yield pb.ExecStreamResponse(
            exited=pb.ExecExited(status=pb.ExitStatus(exit_code=0), stdout_total_bytes=1, stderr_total_bytes=1)
        )

    def ReadFile(self, request, context):
        self._check(context)
        if request.path not in self.files:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no file {request.path}")
        data = self.files[request.path]
        size = READ_CAP if request.limit_bytes == 0 else min(READ_CAP, request.limit_bytes)
        piece = data[request.offset : request.offset + size]
        return pb.ReadFileResponse(data=piece, size_bytes=len(data), truncated=request.offset + len(piece) < len(data))

    def WriteFile(self, request, context):
        self._check(context)
        self.files[request.path] = request.data
        return pb.WriteFileResponse(bytes_written=len(request.data))

    def ListDir(self, request, context):
        self._check(context)
        return pb.ListDirResponse(
            entries=[
                pb.FileInfo(name=path.rsplit("/", 1)[-1], path=path, type=pb.FILE_TYPE_FILE, size_bytes=len(data))
                for path, data in sorted(self.files.items())
            ]
        )

    def Upload(self, request_iterator, context):
        self._check(context)
        self.upload_started.set()
        if not context.add_callback(self.upload_ended.set):
            self.upload_ended.set()  # the call was cancelled before the handler got this far
        first = next(request_iterator)
        if first.WhichOneof("message") != "start":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the first message must carry start")
        archive = b"".join(request.chunk for request in request_iterator)
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            top = tar.getmembers()[0].name
        self.archives[f"{first.start.path}/{top}"] = archive
        return pb.UploadResponse(archive_bytes=len(archive))

    def Download(self, request, context):
        self._check(context)
        if request.path not in self.archives:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no such path {request.path}")
        archive = self.archives[request.path]
        for start in range(0, len(archive), 3000):
            yield pb.DownloadResponse(chunk=archive[start : start + 3000])

    def GetNodeInfo(self, request, context):
        self._check(context)
        return pb.GetNodeInfoResponse(
            version="0.0-fake", daemon_id="fake", default_backend=pb.BACKEND_LOCAL, sandbox_count=len(self.sandboxes)
        )


def serve(service: FakeSandboxService, address: str) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(service, server)
    port = server.add_insecure_port(address)
    server.start()
    return server, port


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeSandboxService, str]]:
    service = FakeSandboxService()
    address = f"unix://{tmp_path}/corral.sock"
    server, _ = serve(service, address)
    yield service, address
    server.stop(grace=None)


@pytest.fixture
def fake_tcp_with_token() -> Iterator[tuple[FakeSandboxService, str]]:
    service = FakeSandboxService(token="s3cret")
    server, port = serve(service, "127.0.0.1:0")
    yield service, f"tcp://127.0.0.1:{port}"
    server.stop(grace=None)


def make_tree(root: Path) -> Path:
    tree = root / "project"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("x = 1\n")
    (tree / "blob").write_bytes(bytes(range(256)) * 100)
    return tree


# ---- sync ------------------------------------------------------------------------------------


def test_sync_example(fake) -> None:
    service, address = fake
    with Client(address) as client, client.create_sandbox(image="host", labels={"job": "1"}) as sandbox:
        result = sandbox.exec(["echo", "hi"], timeout=10)
        assert (result.exit_code, result.stdout, result.text, result.ok) == (0, b"hi\n", "hi\n", True)
        assert service.deadlines[-1] == pytest.approx(10 + EXEC_DEADLINE_MARGIN_S, abs=1)
        assert sandbox.info.backend == "local" and sandbox.info.labels == {"job": "1"}
        assert [info.id for info in client.list_sandboxes({"job": "1"})] == [sandbox.id]
        assert client.list_sandboxes({"job": "2"}) == []
    assert service.sandboxes == {}


def test_sync_exec_variants(fake) -> None:
    service, address = fake
    with Client(address, timeout=7) as client, client.create_sandbox() as sandbox:
        assert sandbox.exec(["cat"], stdin=b"in\x00put").stdout == b"in\x00put"
        assert sandbox.exec("echo $HOME").stdout == b"echo $HOME"
        failed = sandbox.exec(["false"])
        assert (failed.exit_code, failed.stderr) == (1, b"nope\n")
        with pytest.raises(CommandExitError, match="nope") as caught:
            sandbox.exec(["false"], check=True)
        assert caught.value.result.exit_code == 1
        sandbox.refresh()
        assert service.deadlines[-1] == pytest.approx(7, abs=1)


def test_exec_without_a_timeout_leaves_it_to_the_daemon(fake) -> None:
    """One default: a command without `timeout` gets the daemon's exec.default_timeout_s (the
    request says 0), and the call waits for the daemon's answer instead of a client guess."""
    service, address = fake
    with Client(address, timeout=7) as client, client.create_sandbox() as sandbox:
        sandbox.exec(["echo", "hi"])
        assert service.commands[-1].timeout_ms == 0
        assert service.deadlines[-1] > 10**9  # no deadline
        sandbox.exec(["echo", "hi"], timeout=5)
        assert service.commands[-1].timeout_ms == 5000
        assert service.deadlines[-1] == pytest.approx(5 + EXEC_DEADLINE_MARGIN_S, abs=1)


def test_sync_exec_stream(fake) -> None:
    service, address = fake
    with Client(address) as client, client.create_sandbox() as sandbox:
        events = list(sandbox.exec_stream(["run"], keepalive=1))
        assert events[0] == ExecStarted(pid=77)
        assert events[1:3] == [ExecOutput("stdout", b"a"), ExecOutput("stderr", b"b")]
        assert isinstance(events[3], ExecExited) and events[3].exit_code == 0
        with sandbox.exec_stream(["sleep"], timeout=30) as stream:
            assert isinstance(next(stream), ExecStarted)
            assert isinstance(next(stream), ExecKeepalive)
        assert service.stream_cancelled.wait(5)
        assert list(stream) == []


def test_sync_files(fake, tmp_path: Path) -> None:
    service, address = fake
    with Client(address) as client, client.create_sandbox() as sandbox:
        sandbox.write_file("/workspace/notes.txt", "0123456789")
        assert sandbox.read_file("/workspace/notes.txt") == b"0123456789"
        assert sandbox.read_file("/workspace/notes.txt", offset=3, limit=6) == b"345678"
        assert [entry.name for entry in sandbox.list_dir("/workspace")] == ["notes.txt"]
        with pytest.raises(SandboxNotFound):
            sandbox.read_file("/nope")
        tree = make_tree(tmp_path)
        assert sandbox.upload(tree, "/workspace") == "/workspace/project"
        local = sandbox.download("/workspace/project", tmp_path / "back")
        assert local == tmp_path / "back" / "project"
        assert (local / "blob").read_bytes() == (tree / "blob").read_bytes()
        assert (local / "pkg" / "mod.py").read_text() == "x = 1\n"
        with pytest.raises(FileNotFoundError):
            sandbox.upload(tmp_path / "missing", "/workspace")


def failing_chunks(*args, **kwargs) -> Iterator[bytes]:
    yield b"\0" * 512
    raise OSError("disk went away")


def test_sync_upload_failure_aborts_the_call(fake, tmp_path: Path, monkeypatch) -> None:
    service, address = fake
    monkeypatch.setattr("corral.sdk.sync_client.tar_chunks", failing_chunks)
    with Client(address) as client, client.create_sandbox() as sandbox:
        with pytest.raises(OSError, match="disk went away"):
            sandbox.upload(tmp_path, "/w")
        # Cancelled, not left waiting for more chunks. (Under load the cancel can reach the server
        # before the call does, in which case the handler never runs at all.)
        assert service.upload_ended.wait(5) or not service.upload_started.is_set()
    assert service.archives == {}


def test_sync_errors(fake) -> None:
    service, address = fake
    client = Client(address)
    with pytest.raises(SandboxNotFound):
        client.get_sandbox("sb-unknown")
    sandbox = client.create_sandbox()
    sandbox.destroy()
    sandbox.destroy()  # idempotent
    with pytest.raises(InvalidArgument):
        sandbox.exec([])
    client.close()
    with pytest.raises(FailedPrecondition):
        client.node_info()


def test_sync_unreachable_names_address(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/absent.sock"
    with Client(address, timeout=5) as client, pytest.raises(Unavailable, match=address):
        client.node_info()


def test_sync_token_over_tcp(fake_tcp_with_token) -> None:
    _, address = fake_tcp_with_token
    with Client(address) as client, pytest.raises(Unauthenticated):
        client.node_info()
    with Client(address, token="s3cret") as client:
        assert client.node_info().version == "0.0-fake"


# ---- async -----------------------------------------------------------------------------------


async def test_async_example(fake) -> None:
    service, address = fake
    async with AsyncClient(address) as client:
        async with await client.create_sandbox(image="host") as sandbox:
            result = await sandbox.exec(["echo", "hi"], timeout=10)
            assert (result.exit_code, result.stdout) == (0, b"hi\n")
            assert service.deadlines[-1] == pytest.approx(10 + EXEC_DEADLINE_MARGIN_S, abs=1)
            assert [info.id for info in await client.list_sandboxes()] == [sandbox.id]
            assert (await client.node_info()).sandbox_count == 1
        assert service.sandboxes == {}


async def test_async_exec_stream(fake) -> None:
    service, address = fake
    async with AsyncClient(address) as client, await client.create_sandbox() as sandbox:
        events = [event async for event in sandbox.exec_stream(["run"])]
        assert [type(event) for event in events] == [ExecStarted, ExecOutput, ExecOutput, ExecExited]
        async with sandbox.exec_stream(["sleep"], timeout=30) as stream:
            async for event in stream:
                if isinstance(event, ExecKeepalive):
                    break
        assert await asyncio.to_thread(service.stream_cancelled.wait, 5)
        assert [event async for event in stream] == []


async def test_async_cancellation_is_not_converted(fake) -> None:
    _, address = fake
    async with AsyncClient(address) as client, await client.create_sandbox() as sandbox:
        task = asyncio.create_task(sandbox.exec(["sleep"], timeout=30))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_async_files(fake, tmp_path: Path) -> None:
    _, address = fake
    async with AsyncClient(address) as client, await client.create_sandbox() as sandbox:
        await sandbox.write_file("a.bin", b"\x00\x01\x02\x03\x04\x05")
        assert await sandbox.read_file("a.bin") == b"\x00\x01\x02\x03\x04\x05"
        tree = make_tree(tmp_path)
        assert await sandbox.upload(tree, "/w") == "/w/project"
        local = await sandbox.download("/w/project", tmp_path / "back")
        assert (local / "blob").read_bytes() == (tree / "blob").read_bytes()
        with pytest.raises(SandboxNotFound):
            await sandbox.download("/w/missing", tmp_path / "back")


async def test_async_upload_failure_aborts_the_call(fake, tmp_path: Path, monkeypatch) -> None:
    service, address = fake
    monkeypatch.setattr("corral.sdk.client.tar_chunks", failing_chunks)
    async with AsyncClient(address) as client, await client.create_sandbox() as sandbox:
        with pytest.raises(OSError, match="disk went away"):
            await sandbox.upload(tmp_path, "/w")
        ended = await asyncio.to_thread(service.upload_ended.wait, 5)  # cancelled, not left waiting
        assert ended or not service.upload_started.is_set()
    assert service.archives == {}


async def test_async_errors(fake, tmp_path: Path) -> None:
    _, address = fake
    client = AsyncClient(address)
    with pytest.raises(SandboxNotFound):
        await client.get_sandbox("sb-unknown")
    await client.close()
    with pytest.raises(FailedPrecondition):
        await client.node_info()
    async with AsyncClient(f"unix://{tmp_path}/absent.sock", timeout=5) as unreachable:
        with pytest.raises(Unavailable, match="absent.sock"):
            await unreachable.node_info()


async def test_async_token_over_tcp(fake_tcp_with_token) -> None:
    _, address = fake_tcp_with_token
    async with AsyncClient(address) as client:
        with pytest.raises(Unauthenticated):
            await client.node_info()
    async with AsyncClient(address, token="s3cret") as client:
        assert (await client.node_info()).daemon_id == "fake"


def test_async_client_serves_one_event_loop_after_another(fake) -> None:
    """Harnesses that call asyncio.run() per operation (SWE-agent does) use one client across
    loops: each loop gets its own channel, and the sandbox can still be destroyed at the end."""
    service, address = fake
    client = AsyncClient(address)
    sandbox = asyncio.run(client.create_sandbox())
    assert asyncio.run(sandbox.exec(["echo", "hi"], timeout=10)).stdout == b"hi\n"
    asyncio.run(sandbox.destroy())
    assert service.sandboxes == {}
    asyncio.run(client.close())
    with pytest.raises(FailedPrecondition, match="closed"):
        asyncio.run(client.node_info())


def test_async_client_serves_loops_of_several_threads_at_once(fake) -> None:
    """One client used from a loop in another thread while this thread's loop uses it too; closing
    it from here also closes the other loop's channel there."""
    service, address = fake
    client = AsyncClient(address)
    other_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=other_loop.run_forever, daemon=True)
    thread.start()
    try:

        async def main() -> None:
            sandbox = await client.create_sandbox()
            there = asyncio.run_coroutine_threadsafe(sandbox.exec(["echo", "there"], timeout=10), other_loop)
            here = await sandbox.exec(["echo", "here"], timeout=10)
            assert (here.stdout, (await asyncio.wrap_future(there)).stdout) == (b"here\n", b"there\n")
            await sandbox.destroy()
            await client.close()

        asyncio.run(main())
        assert service.sandboxes == {}
        with pytest.raises(FailedPrecondition, match="closed"):
            asyncio.run_coroutine_threadsafe(client.node_info(), other_loop).result(5)
    finally:
        other_loop.call_soon_threadsafe(other_loop.stop)
        thread.join(5)
        other_loop.close()


async def test_async_with_create_sandbox_needs_no_await(fake) -> None:
    """`async with client.create_sandbox()` enters the sandbox and destroys it at the end, as
    `async with await client.create_sandbox()` does; awaiting it (also as a task) gives the handle."""
    service, address = fake
    async with AsyncClient(address) as client:
        async with client.create_sandbox(labels={"job": "1"}) as sandbox:
            assert isinstance(sandbox, AsyncSandbox)
            assert (await sandbox.exec(["echo", "hi"], timeout=10)).stdout == b"hi\n"
            assert list(service.sandboxes) == [sandbox.id]
        assert service.sandboxes == {}
        with pytest.raises(InvalidArgument):
            async with client.create_sandbox(memory_bytes=-1):
                pass
        awaited = await client.create_sandbox()
        tasked = await asyncio.create_task(client.create_sandbox())
        assert sorted(service.sandboxes) == sorted([awaited.id, tasked.id])
        for sandbox in (awaited, tasked):
            await sandbox.destroy()
