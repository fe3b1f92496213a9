"""Kernels without root: the caps on a cell's output and on output that arrives between cells
(pure parts of corral.daemon.kernel_events), the SDK's decoding of them, and real ipykernel
processes (the venv's own, ipykernel being a dev dependency) on the daemon's fake backend: death
and its cause, exit(), late output, invalid requests.

The local, Docker and Apptainer backends are the integration suite's business
(tests/integration/test_kernels.py)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from corral.daemon import kernel_bootstrap, kernel_events
from corral.daemon.embedded import embedded_daemon
from corral.daemon.kernel_events import (
    CellDone,
    DisplayOutput,
    ErrorOutput,
    LateBuffer,
    LateOutput,
    ResultOutput,
    StreamCap,
    StreamOutput,
    gather,
)
from corral.daemon.testing import fake_backends
from corral.sdk import (
    AsyncClient,
    FailedPrecondition,
    InvalidArgument,
    KernelDoneEvent,
    KernelLateOutput,
    KernelStreamEvent,
    ProtocolError,
)
from corral.sdk._core import KernelEventDecoder, kernel_result_from_proto
from corral.v1 import kernel_pb2 as kpb

# -- caps -------------------------------------------------------------------------------------------


async def _events(*events):
    for event in events:
        yield event


async def test_gathering_cuts_the_middle_at_character_boundaries_and_keeps_the_totals() -> None:
    done = CellDone(1, False, False, False, 5, stdout_total_bytes=2 * 3001 + 4, stderr_total_bytes=3)
    cell = await gather(
        _events(StreamOutput("stdout", "ab"), StreamOutput("stdout", "é" * 3000), StreamOutput("stdout", "z"), done),
        1001,  # an odd cap: head and tail halves both end inside a two-byte character
    )
    assert cell.truncated and cell.done is not None and cell.done.truncated
    assert "\ufffd" not in cell.stdout and cell.stdout.startswith("abé") and cell.stdout.endswith("éz")
    assert 1001 - 4 <= len(cell.stdout.encode()) <= 1001
    assert cell.done.stdout_total_bytes == 6006  # the totals are the events' own


async def test_gathering_reports_dropped_displays_as_truncated() -> None:
    done = CellDone(1, False, False, False, 5, displays_dropped=2)
    cell = await gather(_events(StreamOutput("stdout", "short"), done), 1000)
    assert cell.truncated and cell.done is not None and cell.done.truncated and cell.stdout == "short"


def test_a_streamed_cell_forwards_each_stream_up_to_the_cap_and_counts_the_rest(monkeypatch) -> None:
    monkeypatch.setattr(kernel_events, "DISPLAY_LIMIT_BYTES", 10)
    cap = StreamCap(5)
    assert cap.admit(StreamOutput("stdout", "abc")) == StreamOutput("stdout", "abc")
    assert cap.admit(StreamOutput("stdout", "dé!")) == StreamOutput("stdout", "d")  # 'é' would pass the cap
    assert cap.admit(StreamOutput("stdout", "more")) is None
    assert cap.admit(StreamOutput("stderr", "err")) == StreamOutput("stderr", "err")  # a cap of its own
    assert cap.admit(DisplayOutput({"text/plain": b"12345678"})) is not None
    assert cap.admit(DisplayOutput({"text/plain": b"123"})) is None  # dropped whole
    assert cap.admit(ResultOutput({"text/plain": b"x" * 100})) is not None  # the cell's value is kept
    assert cap.totals == {"stdout": 3 + 4 + 4, "stderr": 3} and cap.displays_dropped == 1 and cap.truncated
    unlimited = StreamCap(None)
    assert unlimited.admit(StreamOutput("stdout", "x" * 10_000)) is not None and not unlimited.truncated


def test_late_output_keeps_head_and_tail_and_counts_everything() -> None:
    late = LateBuffer(10)
    assert late.take() is None
    late.add(StreamOutput("stdout", "HEAD-"))
    late.add(StreamOutput("stdout", "x" * 100))
    late.add(StreamOutput("stdout", "-TAIL"))
    late.add(StreamOutput("stderr", "e"))
    late.add(DisplayOutput({"text/plain": b"1234"}))
    late.add(ResultOutput({"text/plain": b"5678"}))
    late.add(ErrorOutput("E", "v", ["tb"]))  # 4 bytes: past the 10 bytes of rich output
    taken = late.take()
    assert taken == LateOutput(
        stdout="HEAD-" + "-TAIL",
        stderr="e",
        displays=[DisplayOutput({"text/plain": b"1234"}), DisplayOutput({"text/plain": b"5678"})],
        errors=[],
        truncated=True,
        stdout_total_bytes=110,
        stderr_total_bytes=1,
        dropped=1,
    )
    assert late.take() is None  # taken once
    late.add(ErrorOutput("Stop", "", []))  # the budget starts again after a take
    assert late.take() == LateOutput(errors=[ErrorOutput("Stop", "", [])])


def test_the_kernel_governor_forwards_the_head_keeps_the_tail_and_counts_everything() -> None:
    """kernel_bootstrap.Window, which runs inside the kernel: past the limit nothing more is
    forwarded, the last `limit` bytes are kept, cut characters go whole and are counted."""
    window = kernel_bootstrap.Window(4)
    assert window.admit("ab") == "ab" and window.closing_message() is None
    assert window.admit("cdé") == "cd"  # 'é' (two bytes) would pass the limit: it goes to the tail
    assert window.admit("xyz") == ""
    # The tail kept the last 4 bytes: half of 'é', then 'xyz'; the half character goes too.
    assert window.total == 2 + 4 + 3 and window.closing_message() == ("xyz", 2)
    window = kernel_bootstrap.Window(4)
    window.admit("abcd")
    window.admit("1234567")
    assert window.closing_message() == ("4567", 3) and window.total == 11


def test_output_the_kernel_skipped_counts_and_cuts_the_tail_kept_before_it() -> None:
    """A stream message that says bytes were dropped before it (the kernel's governor): the caps
    count them and mark truncation; head-and-tail buffers take the text after the gap as the end."""
    cap = StreamCap(10)
    cap.admit(StreamOutput("stdout", "head"))
    assert cap.admit(StreamOutput("stdout", "tail", skipped=100)) is None  # past the cap: dropped
    assert cap.totals["stdout"] == 108 and cap.truncated
    cap.count_totals({"stdout": 50, "stderr": 7})  # fewer than counted: kept; more: lost on the way
    assert cap.totals == {"stdout": 108, "stderr": 7}
    late = LateBuffer(8)
    late.add(StreamOutput("stdout", "HEAD-mid"))
    late.add(StreamOutput("stdout", "TAIL", skipped=5))
    taken = late.take()
    assert taken is not None and taken.stdout == "HEADTAIL" and taken.truncated and taken.stdout_total_bytes == 17


async def test_a_cell_that_reports_more_than_arrived_is_truncated() -> None:
    done = CellDone(1, False, False, False, 5, stdout_total_bytes=100)
    cell = await gather(_events(StreamOutput("stdout", "short"), done), 1000)
    assert cell.truncated and cell.done is not None and cell.done.truncated


# -- the SDK's side ---------------------------------------------------------------------------------


def test_the_sdk_decodes_late_output_only_first_and_the_done_fields() -> None:
    late = kpb.ExecuteResponse(late_output=kpb.KernelLateOutput(stdout="bg\n", stdout_total_bytes=3))
    stream = kpb.ExecuteResponse(stream=kpb.KernelStream(name=kpb.STREAM_NAME_STDOUT, text="x"))
    done = kpb.ExecuteResponse(
        done=kpb.KernelDone(kernel_died=True, exit_code=137, signal=9, oom_killed=True, truncated=True)
    )
    decoder = KernelEventDecoder()
    first = decoder.decode(late)
    assert isinstance(first, KernelLateOutput) and first.stdout == "bg\n" and first.stdout_total_bytes == 3
    assert decoder.decode(stream) == KernelStreamEvent(name="stdout", text="x")
    event = decoder.decode(done)
    assert isinstance(event, KernelDoneEvent) and (event.exit_code, event.signal, event.oom_killed) == (137, 9, True)
    assert event.truncated
    decoder.finish()
    second = KernelEventDecoder()
    second.decode(stream)
    with pytest.raises(ProtocolError, match="late output"):
        second.decode(late)

    gathered = kpb.ExecuteGatheredResponse(
        stdout="own",
        truncated=True,
        done=kpb.KernelDone(kernel_died=True, exit_code=3, stdout_total_bytes=9, stderr_total_bytes=2),
        late_output=kpb.KernelLateOutput(
            stderr="late", errors=[kpb.KernelError(ename="KeyboardInterrupt")], truncated=True, dropped=1
        ),
    )
    result = kernel_result_from_proto(gathered)
    assert result.truncated and (result.stdout_total_bytes, result.stderr_total_bytes) == (9, 2)
    assert result.kernel_died and (result.exit_code, result.signal, result.oom_killed) == (3, 0, False)
    assert not result.ok
    assert result.late_output is not None and result.late_output.stderr == "late" and result.late_output.dropped == 1
    assert [e.ename for e in result.late_output.errors] == ["KeyboardInterrupt"]
    plain = kernel_result_from_proto(kpb.ExecuteGatheredResponse(done=kpb.KernelDone(execution_count=1)))
    assert plain.late_output is None and not plain.truncated and plain.ok


# -- real kernels on the fake backend -----------------------------------------------------------------


@asynccontextmanager
async def fake_sandbox() -> AsyncIterator:
    async with embedded_daemon(backend_classes=fake_backends()) as address, AsyncClient(address) as client:
        sandbox = await client.create_sandbox()
        try:
            yield client, sandbox
        finally:
            await sandbox.destroy()


@asynccontextmanager
async def cpu_load(client, sandboxes: int = 2) -> AsyncIterator[None]:
    """Busy loops in other (fake) sandboxes of the same daemon while the block runs."""
    loaders = [await client.create_sandbox() for _ in range(sandboxes)]
    loops = [asyncio.create_task(sb.exec("while :; do :; done", timeout=120)) for sb in loaders]
    try:
        yield
    finally:
        for sb in loaders:
            await sb.destroy()
        await asyncio.gather(*loops, return_exceptions=True)


async def test_exit_reports_the_kernel_died_and_later_cells_say_why() -> None:
    async with fake_sandbox() as (_, sandbox):
        kernel = await sandbox.kernel(python=sys.executable)
        result = await kernel.execute("print('bye')\nexit()", timeout=30)
        assert result.stdout == "bye\n" and result.kernel_died and not result.ok
        assert (result.exit_code, result.signal) == (0, 0)
        with pytest.raises(FailedPrecondition, match=r"is dead \(exit code 0\)"):
            await kernel.execute("1", timeout=30)
        await kernel.restart()
        died = await kernel.execute("import os\nos._exit(4)", timeout=30)
        assert died.kernel_died and died.exit_code == 4


async def test_late_output_and_a_death_between_cells_reach_the_next_cell_under_load() -> None:
    async with fake_sandbox() as (client, sandbox), cpu_load(client):
        kernel = await sandbox.kernel(python=sys.executable)
        code = (
            "import subprocess, threading, time\n"
            "threading.Timer(0.2, lambda: print('thread', flush=True)).start()\n"
            "subprocess.Popen(['sh', '-c', 'sleep 0.2; echo child'])\n"
            "print('own')"
        )
        first = await kernel.execute(code, timeout=30)
        assert first.stdout == "own\n" and first.late_output is None
        await asyncio.sleep(2)
        async with kernel.execute_stream("print('second')", timeout=30) as events:
            received = [event async for event in events]
        assert isinstance(received[0], KernelLateOutput)
        assert sorted(received[0].stdout.splitlines()) == ["child", "thread"]
        assert received[1] == KernelStreamEvent(name="stdout", text="second\n")

        dying = "import os, threading, time\nthreading.Timer(0.2, lambda: (print('dying', flush=True), time.sleep(0.3), os._exit(6))).start()"
        assert not (await kernel.execute(dying, timeout=30)).kernel_died
        deadline = time.monotonic() + 20
        while (await kernel.refresh()).state != "dead":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        result = await kernel.execute("print('never runs')", timeout=30)
        assert result.kernel_died and result.exit_code == 6 and result.execution_count == 0
        assert result.stdout == "" and result.late_output is not None and result.late_output.stdout == "dying\n"


async def test_a_cell_printing_far_past_the_cap_is_counted_exactly_and_keeps_its_ends() -> None:
    """ipykernel 7 (the venv's) under the output governor: 300 MB printed in 1 MB writes comes back
    as its head and tail with the exact total, though iopub drops what a slow reader leaves behind;
    the kernel keeps working, and output of the gap before the next cell keeps its tail too."""
    code = (
        "import sys\nsys.stdout.write('START')\nfor i in range(300): sys.stdout.write(str(i).rjust(1_000_000))\n"
        "sys.stdout.write('END')"
    )
    async with fake_sandbox() as (_, sandbox):
        kernel = await sandbox.kernel(python=sys.executable)
        result = await kernel.execute(code, timeout=120)
        assert result.stdout_total_bytes == 300_000_008 and result.truncated
        assert result.stdout.startswith("START ") and result.stdout.endswith(" 299END")
        gap = (
            "import threading, sys\n"
            "threading.Timer(0.2, lambda: sys.stdout.write('HEAD' + 'x' * 3_000_000 + 'TAIL')).start()"
        )
        await kernel.execute(gap, timeout=30)
        await asyncio.sleep(1.5)
        result = await kernel.execute("print('next')", timeout=30)
        assert result.stdout == "next\n" and result.late_output is not None
        late = result.late_output
        assert late.stdout.startswith("HEADx") and late.stdout.endswith("xTAIL")
        assert late.truncated and late.stdout_total_bytes == 3_000_008


async def test_invalid_kernel_requests_are_invalid_argument() -> None:
    async with fake_sandbox() as (_, sandbox):
        for python in ("A=B", "-c", "py\0", " "):
            with pytest.raises(InvalidArgument, match="python"):
                await sandbox.kernel(python=python)
        with pytest.raises(InvalidArgument, match="absolute"):
            await sandbox.kernel(python=sys.executable, cwd="relative")
        with pytest.raises(InvalidArgument, match="environment"):
            await sandbox.kernel(python=sys.executable, env={"A=B": "1"})
        assert await sandbox.list_kernels() == []
        kernel = await sandbox.kernel(python=sys.executable)
        with pytest.raises(InvalidArgument, match="NUL"):
            await kernel.execute("a\0b", timeout=30)
        assert (await kernel.execute("1", timeout=30)).execution_count == 1
