"""Background processes and terminals (ShellService StartProcess..ListProcesses, the SDK's
AsyncProcess and AsyncTerminal) on a real daemon in this process with the fake backend; the
screen model and the output ring on their own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator

import pytest

from corral.daemon import pty
from corral.daemon.processes import MAX_BUFFER_BYTES, MAX_BUFFERED_BYTES_PER_SANDBOX, OutputRing
from corral.daemon.server import Daemon
from corral.daemon.testing import fake_backends
from corral.sdk import (
    AsyncClient,
    AsyncSandbox,
    ExpectFailed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from corral.sdk._process_core import Screen
from corral.v1 import shell_pb2 as shell_pb
from tests.unit.test_fake_daemon import config_in


@pytest.fixture
async def sandbox(tmp_path) -> AsyncIterator[AsyncSandbox]:
    daemon = Daemon(config_in(tmp_path), backend_classes=fake_backends())
    await daemon.start()
    try:
        async with AsyncClient(f"unix://{daemon.socket_path}") as client:
            sandbox = await client.create_sandbox()
            yield sandbox
            await sandbox.destroy()
    finally:
        await daemon.stop()


async def test_a_repl_is_driven_by_expect_and_input(sandbox) -> None:
    async with await sandbox.start_process(["python3", "-i", "-q"]) as repl:
        assert repl.info.running and repl.info.argv == ["python3", "-i", "-q"]
        await repl.expect(">>> ", timeout=10)
        await repl.write("print(6 * 7)\n")
        found = await repl.expect(re.compile(r"(\d+)\n>>> "), timeout=10)
        assert found.group(1) == "42"
        await repl.write("exit(3)\n")
        ended = await repl.wait(10)
        assert (ended.running, ended.exit_code) == (False, 3)
        with pytest.raises(FailedPrecondition, match="has ended"):
            await repl.write("1\n")
        with pytest.raises(ExpectFailed) as failed:
            await repl.expect("never", timeout=5)
        assert failed.value.ended


async def test_interrupt_stops_a_sleep_and_wait_times_out_first(sandbox) -> None:
    sleeper = await sandbox.start_process("sleep 30")
    started = time.monotonic()
    waited = await sleeper.wait(0.3)
    assert waited.running and 0.25 <= time.monotonic() - started < 5
    assert (await sleeper.poll()).running
    await sleeper.interrupt()
    ended = await sleeper.wait(10)
    assert not ended.running and ended.exit_code == 130
    with pytest.raises(ExpectFailed) as failed:
        await sleeper.expect("anything", timeout=0.2)
    assert failed.value.ended and failed.value.text == ""


async def test_wait_without_a_timeout_waits_on_the_daemon_instead_of_polling_it(sandbox) -> None:
    # One WaitProcess call that waits (a slice) until the process ends, not one after another.
    process = await sandbox.start_process("sleep 0.5")
    transport = process._transport
    unary, waits = transport.unary, []

    async def counting(method, request, **kwargs):
        if isinstance(request, shell_pb.WaitProcessRequest):
            waits.append(request.timeout_ms)
        return await unary(method, request, **kwargs)

    transport.unary = counting
    try:
        ended = await process.wait()
    finally:
        transport.unary = unary
    assert not ended.running and ended.exit_code == 0
    assert waits == [30_000]


async def test_expect_times_out_with_what_it_saw(sandbox) -> None:
    async with await sandbox.start_process("echo ready; sleep 30") as process:
        started = time.monotonic()
        with pytest.raises(ExpectFailed) as failed:
            await process.expect("done", timeout=0.5)
        assert not failed.value.ended and failed.value.text == "ready\n"
        assert time.monotonic() - started < 5


async def test_a_server_keeps_running_while_other_calls_happen(sandbox) -> None:
    server = await sandbox.start_process("i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.05; done")
    await server.expect("tick 1\n", timeout=10)
    assert (await sandbox.exec("echo other", timeout=10)).stdout == b"other\n"
    other = await sandbox.start_process(["true"])
    assert not (await other.wait(10)).running
    shell = await sandbox.shell()
    assert (await shell.run("echo turn", timeout=10)).output == b"turn\n"
    await server.expect("tick 5\n", timeout=10)
    assert (await server.poll()).running
    assert [p.id for p in await sandbox.list_processes()] == [server.id, other.id]
    await server.close()
    assert [p.id for p in await sandbox.list_processes()] == [other.id]
    with pytest.raises(NotFound):
        await server.poll()


async def test_output_past_the_ring_buffer_is_reported_as_dropped(sandbox) -> None:
    process = await sandbox.start_process("head -c 5000 /dev/zero | tr '\\0' a; echo; echo END", buffer_size=1024)
    assert not (await process.wait(10)).running
    output = await process.read()
    total = 5000 + 1 + 4
    assert output.process.output_end == total and output.process.output_start == total - 1024
    assert (output.offset, output.dropped_bytes, len(output.data)) == (total - 1024, total - 1024, 1024)
    assert output.data.endswith(b"a\nEND\n") and output.next_offset == total == process.offset
    assert process.dropped_bytes == total - 1024
    again = await process.read()
    assert (again.data, again.dropped_bytes) == (b"", 0)


async def test_bad_requests_have_definite_status_codes(sandbox) -> None:
    with pytest.raises(InvalidArgument, match="buffer_bytes"):
        await sandbox.start_process("true", buffer_size=10)
    with pytest.raises(InvalidArgument, match="cwd"):
        await sandbox.start_process("true", cwd="relative")
    process = await sandbox.start_process("echo hi")
    await process.wait(10)
    process._offset = 10_000
    with pytest.raises(InvalidArgument, match="past the end"):
        await process.read()
    with pytest.raises(InvalidArgument, match="signal"):
        await process.send_signal(0)
    await process.close()
    with pytest.raises(NotFound):
        await process.read()
    with pytest.raises(NotFound):
        await process.write("x")
    await process.close()  # already gone: not an error


async def test_a_sandbox_holds_a_bounded_number_of_processes(sandbox) -> None:
    room = MAX_BUFFERED_BYTES_PER_SANDBOX // MAX_BUFFER_BYTES
    running = [await sandbox.start_process("sleep 30", buffer_size=MAX_BUFFER_BYTES) for _ in range(room)]
    with pytest.raises(ResourceExhausted, match="background processes"):
        await sandbox.start_process("true", buffer_size=MAX_BUFFER_BYTES)
    await running[0].interrupt()
    await running[0].wait(10)
    # A finished process makes room, the oldest first.
    replacement = await sandbox.start_process("true", buffer_size=MAX_BUFFER_BYTES)
    ids = [p.id for p in await sandbox.list_processes()]
    assert running[0].id not in ids and replacement.id in ids


async def test_processes_end_with_their_sandbox(sandbox) -> None:
    process = await sandbox.start_process(["sleep", "300"])
    pid = process.info.pid
    os.kill(pid, 0)
    await sandbox.destroy()
    for _ in range(50):
        if not os.path.exists(f"/proc/{pid}"):
            break
        await asyncio.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")


async def test_a_terminal_is_driven_by_keys_and_read_as_text(sandbox) -> None:
    async with await sandbox.terminal(
        ["bash", "--norc", "--noprofile"], env={"PS1": "$ "}, rows=10, cols=60
    ) as terminal:
        await terminal.expect("$ ", timeout=10)
        await terminal.send_keys("echo hi there\r")
        await terminal.expect("hi there\r\n$ ", timeout=10)
        assert (await terminal.screen()).splitlines()[-2:] == ["hi there", "$"]
        # The program says when it runs in the foreground with its SIGINT handler set: a ^C typed
        # sooner can fall between bash's fork and exec, where it is lost (as on any terminal).
        await terminal.send_keys("python3 -c \"print('started'); import time; time.sleep(30)\"\r")
        await terminal.expect("started\r\n", timeout=10)
        await terminal.send_keys("\x03")  # ^C from the keyboard reaches the foreground sleep
        await terminal.expect("$ ", timeout=10)
        await terminal.send_keys("exit 4\r")
        assert (await terminal.wait(10)).exit_code == 4


def test_screen_text_is_what_a_terminal_shows() -> None:
    screen = Screen(rows=3)
    screen.feed(b"one\r\n\x1b[1;31mtw")
    screen.feed(b"o\x1b")  # an escape sequence cut between two reads
    screen.feed(b"[0m\r\nabc\rX\b\bY\n")
    assert screen.text() == "two\nYbc\n"
    screen.feed("é\tz".encode()[:1])
    screen.feed("é\tz".encode()[1:])
    assert screen.text().splitlines()[-1] == "é       z"


def test_the_output_ring_keeps_the_last_bytes_by_offset() -> None:
    ring = OutputRing(4)
    for chunk in (b"ab", b"cdef", b"ghij"):
        ring.append(chunk)
    assert (ring.start, ring.end) == (6, 10)
    assert ring.read(0, 100) == (6, b"ghij") and ring.read(8, 1) == (8, b"i")
    with pytest.raises(InvalidArgument):
        ring.read(11, 1)


async def test_wire_values_out_of_range_are_invalid_arguments(sandbox) -> None:
    transport, service = sandbox._transport, sandbox._transport.shell_service
    process = await sandbox.start_process("sleep 30")
    ids = {"sandbox_id": sandbox.id, "process_id": process.id}
    huge = 2**64 - 1
    refused = [
        (service.StartProcess, shell_pb.StartProcessRequest(sandbox_id=sandbox.id), "argv or as a shell"),
        (service.StartProcess, shell_pb.StartProcessRequest(sandbox_id=sandbox.id, argv=["a"], shell="b"), "exactly"),
        (
            service.StartProcess,
            shell_pb.StartProcessRequest(sandbox_id=sandbox.id, shell="x", buffer_bytes=huge),
            "buffer",
        ),
        (service.ReadProcessOutput, shell_pb.ReadProcessOutputRequest(**ids, offset=huge), "past the end"),
        (service.ReadProcessOutput, shell_pb.ReadProcessOutputRequest(**ids, max_bytes=huge), "max_bytes"),
        (service.ReadProcessOutput, shell_pb.ReadProcessOutputRequest(**ids, wait_ms=huge), "wait_ms"),
        (service.WaitProcess, shell_pb.WaitProcessRequest(**ids, timeout_ms=huge), "timeout_ms"),
        (service.SignalProcess, shell_pb.SignalProcessRequest(**ids, signal=-1), "signal"),
    ]
    for method, request, message in refused:
        with pytest.raises(InvalidArgument, match=message):
            await transport.unary(method, request)
    with pytest.raises(NotFound, match="no-such-sandbox"):
        await transport.unary(service.WaitProcess, shell_pb.WaitProcessRequest(sandbox_id="no-such-sandbox"))
    with pytest.raises(NotFound, match="no background process"):
        await transport.unary(service.WaitProcess, shell_pb.WaitProcessRequest(sandbox_id=sandbox.id, process_id="p0"))
    assert (await process.poll()).running


async def test_a_terminal_child_that_dies_late_is_still_reaped(monkeypatch) -> None:
    # A child that outlives close()'s grace (stuck in the kernel on a loaded node) must not stay a
    # zombie once its pidfd is closed.
    monkeypatch.setattr(pty, "EXIT_GRACE_S", 0.2)
    terminal = pty.Terminal(["sleep", "30"], env=dict(os.environ), cwd="/", rows=24, cols=80, cgroup=None)
    terminal.attach(lambda data: None)
    monkeypatch.setattr(pty.os, "killpg", lambda pid, sig: None)  # the kill does not land in time
    await terminal.close()
    # Closing the terminal hangs it up, and SIGHUP may already have ended (and the reaping thread
    # collected) the child: only a zombie left behind is a failure.
    with contextlib.suppress(ProcessLookupError):
        os.kill(terminal.pid, signal.SIGKILL)
    for _ in range(100):
        if not os.path.exists(f"/proc/{terminal.pid}"):
            break
        await asyncio.sleep(0.05)
    assert not os.path.exists(f"/proc/{terminal.pid}")


async def test_expect_takes_several_patterns_and_the_first_to_match_wins(sandbox) -> None:
    async with await sandbox.start_process("echo 'warming up'; echo 'ready on 8080'; echo error") as process:
        ready, failed = re.compile(r"ready on (\d+)"), "error"
        found = await process.expect([failed, ready], timeout=10)
        assert found.re is ready and found.group(1) == "8080"
        assert (await process.expect([failed, ready], timeout=10)).group(0) == "error"
        with pytest.raises(InvalidArgument):
            await process.expect([], timeout=1)


async def test_an_exit_reported_before_it_can_be_collected_is_still_seen(monkeypatch) -> None:
    # The pidfd can be readable a moment before waitpid can collect the exit (seen on a loaded
    # node): the first waitpid answering "not yet" must not lose the exit.
    real_waitpid, answers = os.waitpid, []

    def waitpid_not_yet_once(pid: int, options: int) -> tuple[int, int]:
        answers.append(pid)
        return (0, 0) if len(answers) == 1 else real_waitpid(pid, options)

    monkeypatch.setattr(pty.os, "waitpid", waitpid_not_yet_once)
    terminal = pty.Terminal(["sh", "-c", "exit 7"], env=dict(os.environ), cwd="/", rows=24, cols=80, cgroup=None)
    terminal.attach(lambda data: None)
    try:
        assert await asyncio.wait_for(terminal.exited, 5) == 7
        assert len(answers) >= 2
    finally:
        await terminal.close()
