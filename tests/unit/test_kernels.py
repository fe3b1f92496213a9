"""Kernels without root: the caps on a cell's output, value and error and on output that arrives
between cells (pure parts of corral.daemon.kernel_events and kernel_bootstrap), the SDK's decoding
of them, and real ipykernel processes (the venv's own, ipykernel being a dev dependency) on the
daemon's fake backend: death and its cause, exit(), restarts on the next cell and their limit,
late output, invalid requests, the rollout's python tool.

The local, Docker and Apptainer backends are the integration suite's business
(tests/integration/test_kernels.py)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from corral.daemon import kernel_bootstrap, kernel_events, kernels
from corral.daemon.config import Config, load_config
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
from corral.rollout.tools import SandboxToolBox
from corral.rollout.types import ToolCall
from corral.sdk import (
    AsyncClient,
    FailedPrecondition,
    InvalidArgument,
    KernelDoneEvent,
    KernelLateOutput,
    KernelResultEvent,
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
        displays=[DisplayOutput({"text/plain": b"1234"}), ResultOutput({"text/plain": b"5678"})],
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


def test_a_value_past_the_cap_keeps_head_and_tail_at_character_boundaries_and_its_total() -> None:
    """kernel_bootstrap.bound_result, which runs inside the kernel before the value is sent: text
    values past the cap keep both ends (as a gathered stream), values that cannot be cut are kept
    while the bundle fits, and the total counts everything."""
    text = "<" + "é" * 20 + ">"  # 42 bytes
    data, truncated, total = kernel_bootstrap.bound_result({"text/plain": text}, 11, 100)
    assert truncated and total == 42
    assert data == {"text/plain": "<éé" + "éé>"}  # 5 + 5 bytes: the cut characters go whole
    assert kernel_bootstrap.cut_text(text, 42) == (text, 42)
    png = base64.b64encode(b"\x89PNG" + b"\0" * 96).decode()  # 100 bytes decoded
    bundle = {"text/plain": "<Image>", "image/png": png, "application/json": {"k": "v"}}
    assert kernel_bootstrap.bound_result(bundle, 11, 200) == (bundle, False, 7 + 100 + 10)
    kept, truncated, total = kernel_bootstrap.bound_result(bundle, 11, 50)  # the image does not fit
    assert kept == {"text/plain": "<Image>", "application/json": {"k": "v"}} and truncated and total == 117
    assert kernel_bootstrap.value_size("image/png", "not base64!") == 11  # the daemon keeps it as text


def test_an_error_past_the_cap_keeps_the_ends_of_its_message_and_traceback() -> None:
    lines = ["Traceback:", "  frame 1", "x" * 50, "ValueError: " + "y" * 50]
    evalue, traceback, truncated, total = kernel_bootstrap.bound_error("ValueError", "m" * 30, lines, 20)
    assert truncated and total == 10 + 30 + sum(len(line) for line in lines)
    assert evalue == "m" * 20
    assert traceback == ["Traceback:", "y" * 10]  # whole lines from the start, the end of the last
    assert kernel_bootstrap.bound_error("E", "short", ["a", "b"], 20) == ("short", ["a", "b"], False, 1 + 5 + 2)
    content = {"ename": "E", "evalue": "v" * 30, "traceback": ["t" * 30]}
    kept = content["traceback"]
    kernel_bootstrap.bound_content("error", content, 10, 100)
    assert content["evalue"] == "v" * 10 and content["corral_truncated"] and content["corral_total_bytes"] == 61
    assert kept == ["t" * 5, "t" * 5]  # cut in place: IPython keeps the list for the reply


def test_a_display_too_large_on_its_own_leaves_the_kernel_without_its_data_and_is_counted() -> None:
    """A display past the displays' cap alone would be dropped whole by the daemon: the kernel
    sends it without its data, and the daemon counts it as dropped; smaller ones pass untouched."""
    big = {"data": {"text/plain": "a" * 101}, "metadata": {}}
    kernel_bootstrap.bound_content("display_data", big, 10, 100)
    assert big == {"data": {}, "metadata": {}, "corral_dropped": True}
    small = {"data": {"text/plain": "a" * 100}}
    kernel_bootstrap.bound_content("update_display_data", small, 10, 100)
    assert small == {"data": {"text/plain": "a" * 100}}
    event = kernel_events.output_event({"msg_type": "display_data", "content": big}, 10)
    assert event == DisplayOutput({}, dropped=True)
    cap, late = StreamCap(None), LateBuffer(100)
    assert cap.admit(event) is None and cap.displays_dropped == 1 and cap.truncated
    late.add(event)
    taken = late.take()
    assert taken is not None and taken.displays == [] and taken.truncated


def test_a_value_or_an_error_that_arrives_uncut_is_cut_by_the_daemon_and_counted() -> None:
    """From a kernel without the bounds (an ipykernel the bootstrap does not know): the daemon cuts
    what arrived before it is forwarded; what the kernel says of its own cut wins."""
    big = {"msg_type": "execute_result", "content": {"data": {"text/plain": "a" * 100}}}
    event = kernel_events.output_event(big, 10)
    assert event == ResultOutput({"text/plain": b"a" * 10}, truncated=True, total_bytes=100)
    cut = {"data": {"text/plain": "aa"}, "corral_truncated": True, "corral_total_bytes": 500}
    assert kernel_events.output_event({"msg_type": "execute_result", "content": cut}, 10) == ResultOutput(
        {"text/plain": b"aa"}, True, 500
    )
    error = {"msg_type": "error", "content": {"ename": "E", "evalue": "v" * 100, "traceback": ["t"]}}
    assert kernel_events.output_event(error, 10) == ErrorOutput("E", "v" * 10, ["t"], True, 102)
    small = kernel_events.output_event({"msg_type": "execute_result", "content": {"data": {"text/plain": "1"}}}, 10)
    assert small == ResultOutput({"text/plain": b"1"}, False, 1)
    cap = StreamCap(None)
    assert cap.admit(event) == event and cap.truncated  # a cut value makes the cell truncated


async def test_a_gathered_cell_with_a_cut_value_is_truncated() -> None:
    done = CellDone(1, False, False, False, 5)
    cell = await gather(_events(ResultOutput({"text/plain": b"ab"}, True, 99), done), 1000)
    assert cell.truncated and cell.done is not None and cell.done.truncated
    cell = await gather(_events(ErrorOutput("E", "v", [], True, 99), done), 1000)
    assert cell.truncated


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
async def fake_sandbox(config: Config | None = None) -> AsyncIterator:
    async with embedded_daemon(config, backend_classes=fake_backends()) as address, AsyncClient(address) as client:
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


# A thread the cell leaves behind prints 'dying' and kills the kernel after the cell's result.
DIES_AFTER_THE_CELL = (
    "import os, threading, time\n"
    "threading.Timer(0.2, lambda: (print('dying', flush=True), time.sleep(0.3), os._exit(6))).start()"
)


async def die_after_the_cell(kernel) -> None:
    """Runs DIES_AFTER_THE_CELL; returns once the kernel is dead."""
    assert not (await kernel.execute(DIES_AFTER_THE_CELL, timeout=30)).kernel_died
    deadline = time.monotonic() + 20
    while (await kernel.refresh()).state != "dead":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_a_dead_kernel_is_restarted_by_the_next_cell_which_says_so() -> None:
    """The default: the cell after a death restarts the kernel (same id) and runs in it; its
    result says the kernel restarted, why it had died, and the state is gone. A kernel that dies
    between cells is restarted the same way, what it printed first coming as late output."""
    async with fake_sandbox() as (_, sandbox):
        kernel = await sandbox.kernel(python=sys.executable)
        assert kernel.info.auto_restart and kernel.info.restarts == 0
        await kernel.execute("kept = 1", timeout=30)
        result = await kernel.execute("print('bye')\nexit()", timeout=30)
        assert result.stdout == "bye\n" and result.kernel_died and not result.ok and not result.restarted
        assert (result.exit_code, result.signal) == (0, 0)
        assert (await kernel.refresh()).state == "dead"
        after = await kernel.execute("'kept' in dir()", timeout=30)
        assert after.restarted and after.restart_reason == "exit code 0" and after.result_text == "False"
        assert after.ok and after.execution_count == 1 and not after.kernel_died
        info = await kernel.refresh()
        assert (info.id, info.state, info.restarts, info.execution_count) == (kernel.id, "idle", 1, 1)
        assert not (await kernel.execute("1", timeout=30)).restarted  # once

        await die_after_the_cell(kernel)
        result = await kernel.execute("print('runs')", timeout=30)
        assert result.restarted and result.restart_reason == "exit code 6" and not result.kernel_died
        assert result.stdout == "runs\n" and result.execution_count == 1
        assert result.late_output is not None and result.late_output.stdout == "dying\n"
        assert (await kernel.refresh()).restarts == 2
        await kernel.restart()  # RestartKernel counts too
        assert kernel.info.restarts == 3


async def test_a_kernel_started_without_auto_restart_stays_dead_until_restarted() -> None:
    """auto_restart=False keeps the behaviour before automatic restarts: later cells say why the
    kernel is dead until RestartKernel; a death between cells is reported by the next cell, which
    does not run."""
    async with fake_sandbox() as (_, sandbox):
        kernel = await sandbox.kernel(python=sys.executable, auto_restart=False)
        assert not kernel.info.auto_restart
        result = await kernel.execute("print('bye')\nexit()", timeout=30)
        assert result.stdout == "bye\n" and result.kernel_died and not result.ok
        with pytest.raises(FailedPrecondition, match=r"is dead \(exit code 0\); RestartKernel brings it back"):
            await kernel.execute("1", timeout=30)
        await kernel.restart()
        died = await kernel.execute("import os\nos._exit(4)", timeout=30)
        assert died.kernel_died and died.exit_code == 4 and not died.restarted
        with pytest.raises(FailedPrecondition, match=r"is dead \(exit code 4\)"):
            await kernel.execute("1", timeout=30)
        assert (await kernel.refresh()).restarts == 1


async def test_automatic_restarts_stop_at_the_limit_until_restart_kernel() -> None:
    """A kernel that dies at every cell is restarted kernel.max_auto_restarts times within the
    window; then cells get FAILED_PRECONDITION naming the limit, and RestartKernel still works."""
    config = load_config(environ={})
    config = dataclasses.replace(
        config, kernel=dataclasses.replace(config.kernel, max_auto_restarts=2, auto_restart_window_s=3600)
    )
    async with fake_sandbox(config) as (_, sandbox):
        kernel = await sandbox.kernel(python=sys.executable)
        crash = "import os\nos._exit(9)"
        assert (await kernel.execute(crash, timeout=30)).kernel_died
        for _ in range(2):
            result = await kernel.execute(crash, timeout=30)
            assert result.restarted and result.kernel_died and result.restart_reason == "exit code 9"
        with pytest.raises(FailedPrecondition) as refused:
            await kernel.execute("1", timeout=30)
        message = str(refused.value)
        assert "is dead (exit code 9)" in message and "RestartKernel brings it back" in message
        assert "restarted automatically 2 times within 3600 s" in message and "kernel.max_auto_restarts = 2" in message
        assert (await kernel.refresh()).state == "dead"
        await kernel.restart()
        assert (await kernel.execute("2 * 21", timeout=30)).result_text == "42"
        assert kernel.info.restarts == 3


async def test_the_python_tool_tells_the_agent_the_kernel_restarted_and_its_state_is_gone(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "DEFAULT_PYTHON", sys.executable)  # the fake sandbox's python3 may lack ipykernel
    async with fake_sandbox() as (_, sandbox):
        box = SandboxToolBox(sandbox, ["python"], workdir="/tmp", max_observation_bytes=4096)
        try:

            async def python(code: str) -> str:
                return (await box.call(ToolCall("python", {"code": code}), 30)).text

            assert await python("x = 1\nprint('set')") == "set"
            died = await python("import os\nos._exit(3)")
            assert "[the kernel died and was restarted: all variables are lost]" in died
            assert "NameError" in await python("x")
            await python("import os, threading\nthreading.Timer(0.2, lambda: os._exit(5)).start()")
            await asyncio.sleep(1.5)
            text = await python("print('after')")
            assert text.startswith("[the kernel had died (exit code 5) and was restarted before this code ran: ")
            assert text.endswith("after")
        finally:
            await box.close()


async def test_a_big_value_and_a_big_error_come_back_cut_at_both_ends_and_counted(monkeypatch) -> None:
    """A 20 MB value and a 20 MB error message are cut inside the kernel (ipykernel 7, the venv's;
    the daemon's own cut is off here): both ends of the output cap come back, with the totals; a
    value's image past 16 MiB is dropped and its text kept."""
    monkeypatch.setattr(kernel_events, "bound_result", lambda data, limit, display_limit: (data, False, 0))
    monkeypatch.setattr(kernel_events, "bound_error", lambda ename, evalue, lines, limit: (evalue, lines, False, 0))
    cap = load_config(environ={}).exec.default_output_limit_bytes
    async with fake_sandbox() as (_, sandbox):
        kernel = await sandbox.kernel(python=sys.executable)
        result = await kernel.execute("x = 'é' * 10_000_000 + 'END'\nx", timeout=60)
        text = result.result_text
        assert text is not None and text.startswith("'éé") and text.endswith("éEND'")
        assert cap - 4 <= len(text.encode()) <= cap and result.result_truncated and result.truncated
        assert result.result_total_bytes == 20_000_005 and result.ok
        async with kernel.execute_stream("x", timeout=60) as events:
            streamed = [e async for e in events]
        value = next(e for e in streamed if isinstance(e, KernelResultEvent))
        assert value.truncated and value.total_bytes == 20_000_005 and len(value.data["text/plain"]) <= cap
        assert isinstance(streamed[-1], KernelDoneEvent) and streamed[-1].truncated

        error = await kernel.execute("raise ValueError('<' + 'y' * 20_000_000 + '>')", timeout=60)
        assert error.error is not None and error.error.ename == "ValueError" and error.error.truncated
        assert error.error.evalue.startswith("<yy") and error.error.evalue.endswith("yy>")
        assert len(error.error.evalue) == cap and sum(len(line.encode()) for line in error.error.traceback) <= cap
        assert error.error.total_bytes > 40_000_000 and error.truncated

        image = (
            "from IPython.display import Image\n"
            "Image(data=b'\\x89PNG\\r\\n\\x1a\\n' + bytes(17 << 20), format='png', embed=True)"
        )
        shown = await kernel.execute(image, timeout=60)
        assert shown.result is not None and "image/png" not in shown.result and "text/plain" in shown.result
        assert shown.result_truncated and shown.result_total_bytes > 17 << 20
        assert (await kernel.execute("'after'", timeout=30)).result_text == "'after'"


async def test_late_output_and_a_death_between_cells_reach_the_next_cell_under_load() -> None:
    """Without auto_restart, the cell after a death between cells does not run: it reports the
    death (its cause, what the kernel printed before dying)."""
    async with fake_sandbox() as (client, sandbox), cpu_load(client):
        kernel = await sandbox.kernel(python=sys.executable, auto_restart=False)
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

        await die_after_the_cell(kernel)
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
