"""IPython kernels through the SDK (`Sandbox.kernel`, `Kernel`, their asyncio twins) against a real
daemon: the SDK's wrappers, above the backend, on one backend case (tests/README.md;
test_kernels.py holds what differs per backend).

The sandbox's python is the host image's python3, which needs ipykernel (Debian: python3-ipykernel).
"""

from __future__ import annotations

import threading
import time

import pytest

from corral.sdk import (
    AsyncClient,
    FailedPrecondition,
    InvalidArgument,
    KernelDisplayEvent,
    KernelDoneEvent,
    KernelErrorEvent,
    KernelInfo,
    KernelLateOutput,
    KernelResult,
    KernelResultEvent,
    KernelStreamEvent,
    NotFound,
    Unimplemented,
)

# Every test here starts kernels (or checks what happens when it cannot): see kernel_python.
pytestmark = [pytest.mark.local, pytest.mark.above_backend, pytest.mark.usefixtures("kernel_python")]


@pytest.fixture
def kernel(sandbox):
    try:
        sandbox.list_kernels()
    except Unimplemented:
        pytest.skip("KernelService is not registered in this daemon")
    with sandbox.kernel() as k:
        yield k


def test_execute_keeps_state_and_gathers_outputs(sandbox, kernel):
    assert kernel.id.startswith("k-") and kernel.sandbox_id == sandbox.id
    assert isinstance(kernel.info, KernelInfo) and kernel.info.state == "idle" and kernel.info.python
    result = kernel.execute("import sys\nx = 40\nprint('out')\nprint('err', file=sys.stderr)\nx + 2")
    assert isinstance(result, KernelResult) and result.ok
    assert (result.stdout, result.stderr, result.result_text) == ("out\n", "err\n", "42")
    assert result.error is None and result.displays == [] and result.execution_count == 1
    assert not result.timed_out and not result.kernel_died
    assert kernel.execute("x").result_text == "40"
    assert kernel.execute("y = x").result is None
    assert kernel.refresh().execution_count == 3


def test_errors_and_rich_output(kernel):
    failed = kernel.execute("1 / 0")
    assert not failed.ok and failed.result is None and failed.result_text is None
    assert failed.error.ename == "ZeroDivisionError" and "division by zero" in failed.error.evalue
    assert any("ZeroDivisionError" in line for line in failed.error.traceback)
    shown = kernel.execute("from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))\n{'a': 1}")
    assert len(shown.displays) == 1 and shown.displays[0]["text/html"] == b"<b>hi</b>"
    assert shown.result_text == "{'a': 1}"


def test_execute_stream_yields_typed_events(kernel):
    code = (
        "import time, sys\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.05)\n"
        "print('e', file=sys.stderr)\nfrom IPython.display import display\ndisplay('shown')\n'last'"
    )
    with kernel.execute_stream(code, timeout=30) as events:
        received = list(events)
    assert isinstance(received[-1], KernelDoneEvent) and not received[-1].failed
    assert sum(isinstance(event, KernelDoneEvent) for event in received) == 1
    stdout = "".join(e.text for e in received if isinstance(e, KernelStreamEvent) and e.name == "stdout")
    assert stdout == "0\n1\n2\n"
    assert [e.text for e in received if isinstance(e, KernelStreamEvent) and e.name == "stderr"] == ["e\n"]
    assert [e.data["text/plain"] for e in received if isinstance(e, KernelDisplayEvent)] == [b"'shown'"]
    assert [e.data["text/plain"] for e in received if isinstance(e, KernelResultEvent)] == [b"'last'"]

    errors = list(kernel.execute_stream("raise ValueError('bad')"))
    assert isinstance(errors[0], KernelErrorEvent) and errors[0].ename == "ValueError" and errors[0].evalue == "bad"
    assert isinstance(errors[-1], KernelDoneEvent) and errors[-1].failed


def test_closing_a_stream_early_interrupts_the_cell(kernel):
    events = kernel.execute_stream("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout=120)
    first = next(events)
    assert isinstance(first, KernelStreamEvent) and first.text == "started\n"
    events.close()
    assert list(events) == []
    started = time.monotonic()
    assert kernel.execute("1 + 1", timeout=30).result_text == "2"
    assert time.monotonic() - started < 20


def test_timeout_interrupt_restart_shutdown(sandbox, kernel):
    kernel.execute("kept = 1")
    slow = kernel.execute("import time\ntime.sleep(60)", timeout=1)
    assert slow.timed_out and not slow.kernel_died and not slow.ok
    assert kernel.execute("kept").result_text == "1"

    # interrupt() stops a running cell, as Jupyter's stop button does.
    timer = threading.Timer(1.0, kernel.interrupt)
    timer.start()
    try:
        interrupted = kernel.execute("import time\ntime.sleep(60)", timeout=60)
    finally:
        timer.cancel()
    assert interrupted.error is not None and interrupted.error.ename == "KeyboardInterrupt"

    info = kernel.restart()
    assert info.id == kernel.id and info.execution_count == 0 and kernel.info == info
    assert kernel.execute("kept").error.ename == "NameError"

    assert [k.id for k in sandbox.list_kernels()] == [kernel.id]
    assert sandbox.get_kernel(kernel.id).info.id == kernel.id
    kernel.shutdown()
    kernel.shutdown()  # shutting down twice, or a kernel that is gone, is not an error
    assert sandbox.list_kernels() == []
    with pytest.raises(NotFound):
        kernel.execute("1")
    with pytest.raises(NotFound):
        sandbox.get_kernel(kernel.id)


def test_results_say_truncation_death_and_late_output(kernel):
    big = kernel.execute("print('x' * 3_000_000)", timeout=60)
    assert big.truncated and big.stdout_total_bytes == 3_000_001 and len(big.stdout) == 1 << 20
    assert big.ok  # a long output is not a failure
    kernel.execute("import threading\nthreading.Timer(0.3, lambda: print('later', flush=True)).start()")
    time.sleep(2)
    after = kernel.execute("1")
    assert isinstance(after.late_output, KernelLateOutput) and after.late_output.stdout == "later\n"
    assert after.result_text == "1" and after.stdout == ""
    with kernel.execute_stream("exit()") as events:
        done = list(events)[-1]
    assert isinstance(done, KernelDoneEvent) and done.kernel_died and (done.exit_code, done.signal) == (0, 0)
    assert kernel.refresh().state == "dead"
    restarted = kernel.execute("1")
    assert restarted.restarted and restarted.restart_reason == "exit code 0" and restarted.result_text == "1"
    assert kernel.refresh().restarts == 1 and kernel.info.auto_restart
    big = kernel.execute("'v' * 3_000_000")
    assert big.result_truncated and big.result_total_bytes == 3_000_002 and big.truncated and big.ok


def test_a_kernel_without_auto_restart_stays_dead(sandbox, kernel):
    with sandbox.kernel(auto_restart=False) as fragile:
        assert not fragile.info.auto_restart
        with fragile.execute_stream("exit()") as events:
            done = list(events)[-1]
        assert isinstance(done, KernelDoneEvent) and done.kernel_died and not done.restarted
        with pytest.raises(FailedPrecondition, match=r"dead \(exit code 0\)"):
            fragile.execute("1")
        assert fragile.restart().restarts == 1
        assert fragile.execute("1").result_text == "1"


def test_start_errors(sandbox, kernel):
    with pytest.raises(FailedPrecondition):
        sandbox.kernel(python="/no/such/python3")
    with pytest.raises(InvalidArgument):
        kernel.execute(b"1")  # bytes, not str
    with pytest.raises(InvalidArgument):
        kernel.execute("1", timeout=-1)


async def test_async_kernel(daemon):
    async with AsyncClient(daemon.address) as client:
        async with await client.create_sandbox() as sandbox:
            try:
                await sandbox.list_kernels()
            except Unimplemented:
                pytest.skip("KernelService is not registered in this daemon")
            async with await sandbox.kernel() as kernel:
                await kernel.execute("n = 6")
                assert (await kernel.execute("n * 7")).result_text == "42"
                async with kernel.execute_stream("print('a')\nn") as events:
                    received = [event async for event in events]
                assert received[0] == KernelStreamEvent(name="stdout", text="a\n")
                assert isinstance(received[-1], KernelDoneEvent)
                assert [k.id for k in await sandbox.list_kernels()] == [kernel.id]
                await kernel.restart()
                assert (await kernel.execute("n")).error.ename == "NameError"
                kernel_id = kernel.id
            assert await sandbox.list_kernels() == []
            with pytest.raises(NotFound):
                await sandbox.get_kernel(kernel_id)


# ---- the sans-IO part, without a daemon ----------------------------------------------------------


def test_event_decoder_enforces_done_last():
    from corral.sdk import ProtocolError
    from corral.sdk._core import KernelEventDecoder, kernel_result_from_proto
    from corral.v1 import kernel_pb2 as kpb

    decoder = KernelEventDecoder()
    stream = kpb.ExecuteResponse(stream=kpb.KernelStream(name=kpb.STREAM_NAME_STDERR, text="x"))
    assert decoder.decode(stream) == KernelStreamEvent(name="stderr", text="x")
    with pytest.raises(ProtocolError, match="without a done event"):
        decoder.finish()
    done = decoder.decode(kpb.ExecuteResponse(done=kpb.KernelDone(execution_count=4, failed=True)))
    assert done == KernelDoneEvent(execution_count=4, failed=True, timed_out=False, kernel_died=False, duration_ms=0)
    decoder.finish()
    with pytest.raises(ProtocolError, match="after the done event"):
        decoder.decode(stream)
    with pytest.raises(ProtocolError):
        KernelEventDecoder().decode(kpb.ExecuteResponse())
    with pytest.raises(ProtocolError, match="done"):
        kernel_result_from_proto(kpb.ExecuteGatheredResponse(stdout="no done"))


def test_cell_deadline_leaves_room_for_the_interrupt():
    from corral.sdk._core import KERNEL_DEADLINE_MARGIN_S, kernel_deadline

    assert kernel_deadline(60.0) == 60.0 + KERNEL_DEADLINE_MARGIN_S and KERNEL_DEADLINE_MARGIN_S >= 10
