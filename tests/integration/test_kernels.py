"""KernelService against a real daemon: ipykernel processes inside sandboxes, driven through the
raw gRPC stubs. What differs per backend (a kernel's start, interrupts and kills inside the
sandbox, its sockets in the shared run directory, death and restart, memory) runs on every backend
case; event shapes, caps and late output, the daemon's logic above the kernel, on one
(tests/README.md); one test runs without namespaces.

A local sandbox's python is the host image's python3, which needs ipykernel (Debian:
python3-ipykernel).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import time
import uuid
import zlib
from pathlib import Path

import grpc
import pytest

from corral.sdk import Client
from corral.v1 import kernel_pb2 as kpb
from corral.v1 import kernel_pb2_grpc
from tests.conftest import DaemonProcess, require_backend

# Every test here starts kernels (or checks what happens when it cannot): see kernel_python.
pytestmark = [pytest.mark.local, pytest.mark.usefixtures("kernel_python")]


@pytest.fixture
def stub(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        yield kernel_pb2_grpc.KernelServiceStub(channel)


@pytest.fixture
def kernel(stub, sandbox) -> kpb.KernelInfo:
    return stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id), timeout=60).kernel


def run(stub, kernel: kpb.KernelInfo, code: str, timeout_ms: int = 0) -> kpb.ExecuteGatheredResponse:
    request = kpb.ExecuteGatheredRequest(
        sandbox_id=kernel.sandbox_id, kernel_id=kernel.kernel_id, code=code, timeout_ms=timeout_ms
    )
    return stub.ExecuteGathered(request, timeout=60)


def stream(stub, kernel: kpb.KernelInfo, code: str, timeout_ms: int = 0):
    request = kpb.ExecuteRequest(
        sandbox_id=kernel.sandbox_id, kernel_id=kernel.kernel_id, code=code, timeout_ms=timeout_ms
    )
    return stub.Execute(request, timeout=60)


def state_of(stub, kernel: kpb.KernelInfo) -> int:
    (info,) = stub.ListKernels(kpb.ListKernelsRequest(sandbox_id=kernel.sandbox_id)).kernels
    return info.state


def tiny_png() -> bytes:
    """A valid 1x1 red PNG, built by hand so the test needs no imaging library."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xff\x00\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def eventfds(pid: int) -> int:
    """How many eventfds a process holds: every zmq socket has one (its mailbox)."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            held += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[eventfd]"
    return held


def host_processes_with(marker: str) -> list[int]:
    """Host pids whose environment carries `marker` (the test runs as root, like the daemon)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


# -- cells ----------------------------------------------------------------------------------------


def test_state_persists_across_cells(stub, kernel):
    assert run(stub, kernel, "x = 41").done.execution_count == 1
    reply = run(stub, kernel, "x + 1")
    assert reply.result.data["text/plain"] == b"42"
    assert reply.done.execution_count == 2 and not reply.done.failed


@pytest.mark.above_backend
def test_stdout_and_stderr_arrive_as_stream_events_then_one_done(stub, kernel):
    code = "import sys\nprint('to out')\nsys.stdout.flush()\nprint('to err', file=sys.stderr)\nsys.stderr.flush()"
    events = list(stream(stub, kernel, code))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-1] == "done" and kinds.count("done") == 1
    texts = [(e.stream.name, e.stream.text) for e in events if e.HasField("stream")]
    assert (kpb.STREAM_NAME_STDOUT, "to out\n") in texts
    assert (kpb.STREAM_NAME_STDERR, "to err\n") in texts
    gathered = run(stub, kernel, code)
    assert (gathered.stdout, gathered.stderr) == ("to out\n", "to err\n")
    assert not gathered.HasField("result")


@pytest.mark.above_backend
def test_last_expression_is_the_result_as_text_plain(stub, kernel):
    reply = run(stub, kernel, "'ab' * 2")
    assert reply.result.data["text/plain"] == b"'abab'"
    assert not run(stub, kernel, "y = 1").HasField("result")  # an assignment has no value


@pytest.mark.above_backend
def test_display_data_carries_decoded_png_bytes_and_html(stub, kernel):
    png = tiny_png()
    code = (
        "from IPython.display import HTML, Image, display\n"
        f"display(Image(data=bytes.fromhex('{png.hex()}')))\n"
        "display(HTML('<b>bold</b>'))\n"
        "{'answer': 42}"
    )
    reply = run(stub, kernel, code)
    image, html = reply.displays
    assert image.data["image/png"] == png  # the bytes themselves, not base64
    assert html.data["text/html"] == b"<b>bold</b>"
    assert reply.result.data["text/plain"] == b"{'answer': 42}"
    json_reply = run(stub, kernel, "from IPython.display import JSON\nJSON({'a': [1, 2]})")
    assert json.loads(json_reply.result.data["application/json"]) == {"a": [1, 2]}


@pytest.mark.above_backend
def test_an_exception_is_an_error_event_and_the_kernel_goes_on(stub, kernel):
    events = list(stream(stub, kernel, "raise ValueError('bad value')"))
    (error,) = [e.error for e in events if e.HasField("error")]
    assert (error.ename, error.evalue) == ("ValueError", "bad value")
    assert any("ValueError" in line for line in error.traceback)
    assert events[-1].done.failed
    assert run(stub, kernel, "1 + 1").result.data["text/plain"] == b"2"


@pytest.mark.above_backend
def test_timeout_interrupts_the_cell_and_keeps_the_state(stub, kernel):
    run(stub, kernel, "survivor = 'still here'")
    started = time.monotonic()
    reply = run(stub, kernel, "import time\ntime.sleep(60)", timeout_ms=500)
    assert time.monotonic() - started < 10
    assert reply.done.timed_out and not reply.done.kernel_died
    assert reply.error.ename == "KeyboardInterrupt"
    assert run(stub, kernel, "survivor").result.data["text/plain"] == b"'still here'"
    assert state_of(stub, kernel) == kpb.KERNEL_STATE_IDLE


def test_interrupt_rpc_stops_a_running_cell(stub, kernel):
    events = stream(stub, kernel, "import time\nprint('started', flush=True)\ntime.sleep(60)")
    first = next(events)
    assert first.stream.text == "started\n"
    assert state_of(stub, kernel) == kpb.KERNEL_STATE_BUSY
    started = time.monotonic()
    stub.InterruptKernel(kpb.InterruptKernelRequest(sandbox_id=kernel.sandbox_id, kernel_id=kernel.kernel_id))
    rest = list(events)
    assert time.monotonic() - started < 10
    assert [e.error.ename for e in rest if e.HasField("error")] == ["KeyboardInterrupt"]
    assert not rest[-1].done.timed_out and not rest[-1].done.kernel_died
    assert run(stub, kernel, "'alive'").result.data["text/plain"] == b"'alive'"


def test_a_cell_that_ignores_the_interrupt_is_killed_after_its_grace(stub, kernel):
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    started = time.monotonic()
    reply = run(stub, kernel, code, timeout_ms=300)
    assert time.monotonic() - started < 15
    assert reply.done.timed_out and reply.done.kernel_died
    assert state_of(stub, kernel) == kpb.KERNEL_STATE_DEAD


@pytest.mark.above_backend
def test_a_cell_whose_caller_goes_away_is_interrupted(stub, kernel):
    events = stream(stub, kernel, "import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert next(events).stream.text == "started\n"
    events.cancel()
    # Had the abandoned cell kept running, this one would queue behind it and time out.
    reply = run(stub, kernel, "'next'", timeout_ms=10_000)
    assert not reply.done.timed_out
    assert reply.result.data["text/plain"] == b"'next'"


# -- kernel lifecycle -----------------------------------------------------------------------------


def info_of(stub, kernel: kpb.KernelInfo) -> kpb.KernelInfo:
    (info,) = stub.ListKernels(kpb.ListKernelsRequest(sandbox_id=kernel.sandbox_id)).kernels
    return info


def test_kernel_death_is_reported_and_restart_gives_a_fresh_kernel(stub, sandbox):
    """A kernel started without auto_restart: after its death cells are refused until
    RestartKernel, which brings it back under the same id with a fresh namespace."""
    request = kpb.StartKernelRequest(sandbox_id=sandbox.id, auto_restart=False)
    kernel = stub.StartKernel(request, timeout=60).kernel
    assert not kernel.auto_restart
    run(stub, kernel, "before_death = 1")
    reply = run(stub, kernel, "import os\nos._exit(1)")
    assert reply.done.kernel_died
    assert state_of(stub, kernel) == kpb.KERNEL_STATE_DEAD
    with pytest.raises(grpc.RpcError) as err:
        run(stub, kernel, "1")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    restarted = stub.RestartKernel(
        kpb.RestartKernelRequest(sandbox_id=kernel.sandbox_id, kernel_id=kernel.kernel_id), timeout=60
    ).kernel
    assert restarted.kernel_id == kernel.kernel_id and restarted.restarts == 1
    assert restarted.state == kpb.KERNEL_STATE_IDLE and restarted.execution_count == 0
    assert run(stub, kernel, "'before_death' in dir()").result.data["text/plain"] == b"False"


# Cells that kill their kernel, and why the next cell, which restarts it, says it had died.
KERNEL_DEATHS = [
    ("import os\nos._exit(3)", "exit code 3"),
    ("exit()", "exit code 0"),
    # Recursion through a C function (map) overflows the C stack once the recursion limit allows.
    (
        "import sys\nsys.setrecursionlimit(10**6)\ndef f(n):\n    return list(map(f, [n + 1]))\nf(0)",
        "killed by signal 11",
    ),
]
# Forked copies of the kernel fork on at the pids limit, ignoring the timeout's interrupt: the
# daemon kills the kernel's tree.
FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "killed by signal 9, after ignoring the timeout's interrupt",
)


def test_a_kernel_its_cell_killed_comes_back_on_the_next_cell(stub, client):
    """os._exit, exit(), a stack overflow and a fork bomb at the sandbox's pids limit kill the
    kernel; the next cell restarts it (same id), runs, and says so, with the cause and none of the
    earlier state."""
    with client.create_sandbox(pids=64) as sb:
        pids = next(s for s in sb.info.limit_status if s.kind == "pids")
        deaths = KERNEL_DEATHS + ([FORK_BOMB] if pids.enforced else [])  # no fork bomb on the host
        kernel = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sb.id), timeout=60).kernel
        assert kernel.auto_restart and kernel.restarts == 0
        for restarts, (code, cause) in enumerate(deaths, 1):
            run(stub, kernel, "state = 1")
            died = run(stub, kernel, code, timeout_ms=2000)
            assert died.done.kernel_died and not died.done.restarted, code
            assert state_of(stub, kernel) == kpb.KERNEL_STATE_DEAD
            after = run(stub, kernel, "'state' in dir()")
            assert after.done.restarted and after.done.restart_reason == cause, code
            assert after.result.data["text/plain"] == b"False" and after.done.execution_count == 1
            info = info_of(stub, kernel)
            assert (info.kernel_id, info.state, info.restarts) == (kernel.kernel_id, kpb.KERNEL_STATE_IDLE, restarts)


@pytest.mark.above_backend
def test_restart_during_a_cell_ends_it_as_kernel_died(stub, kernel):
    events = stream(stub, kernel, "import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert next(events).stream.text == "started\n"
    stub.RestartKernel(kpb.RestartKernelRequest(sandbox_id=kernel.sandbox_id, kernel_id=kernel.kernel_id), timeout=60)
    assert list(events)[-1].done.kernel_died
    assert run(stub, kernel, "2 * 21").result.data["text/plain"] == b"42"


def test_missing_ipykernel_is_failed_precondition(stub, sandbox):
    """A fresh venv made inside the sandbox is a real python without ipykernel (it does not see
    the system's dist-packages), like an image that never installed it."""
    sandbox.exec(["python3", "-m", "venv", "--without-pip", "/tmp/bare"], check=True)
    with pytest.raises(grpc.RpcError) as err:
        stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id, python="/tmp/bare/bin/python"), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "/tmp/bare/bin/python in this sandbox has no ipykernel" in err.value.details()
    assert "pip install ipykernel" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id, python="/no/such/python"), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot run /no/such/python" in err.value.details()
    assert stub.ListKernels(kpb.ListKernelsRequest(sandbox_id=sandbox.id)).kernels == []


@pytest.mark.above_backend
def test_unknown_kernel_or_sandbox_is_not_found(stub, sandbox):
    ids = {"sandbox_id": sandbox.id, "kernel_id": "k-00000000"}
    calls = [
        lambda: run(stub, kpb.KernelInfo(**ids), "1"),
        lambda: list(stream(stub, kpb.KernelInfo(**ids), "1")),
        lambda: stub.InterruptKernel(kpb.InterruptKernelRequest(**ids)),
        lambda: stub.RestartKernel(kpb.RestartKernelRequest(**ids)),
        lambda: stub.ShutdownKernel(kpb.ShutdownKernelRequest(**ids)),
        lambda: stub.ListKernels(kpb.ListKernelsRequest(sandbox_id="sb-000000000000")),
        lambda: stub.StartKernel(kpb.StartKernelRequest(sandbox_id="sb-000000000000")),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.above_backend
def test_shutdown_stops_the_kernel_and_forgets_it(stub, sandbox):
    marker = f"CORRAL_TEST_{uuid.uuid4().hex}"
    kernel = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id, env={marker: "1"}), timeout=60).kernel
    assert host_processes_with(marker)
    stub.ShutdownKernel(kpb.ShutdownKernelRequest(sandbox_id=sandbox.id, kernel_id=kernel.kernel_id))
    assert host_processes_with(marker) == []
    assert stub.ListKernels(kpb.ListKernelsRequest(sandbox_id=sandbox.id)).kernels == []
    left = sandbox.exec(["ls", "-A", "/run/corral"], check=True).stdout.decode().split()
    assert [name for name in left if name.startswith("k")] == []  # sockets and connection file


def test_destroying_the_sandbox_stops_its_kernels(daemon, stub, client):
    """The processes die with the sandbox anyway; the daemon's side of each kernel (its client
    sockets) must go with them: the daemon holds no more zmq sockets than before."""
    marker = f"CORRAL_TEST_{uuid.uuid4().hex}"
    sandbox = client.create_sandbox()
    warm = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id), timeout=60).kernel
    stub.ShutdownKernel(kpb.ShutdownKernelRequest(sandbox_id=sandbox.id, kernel_id=warm.kernel_id))
    eventfds_before = eventfds(daemon.proc.pid)
    for _ in range(2):
        stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id, env={marker: "1"}), timeout=60)
    assert len(host_processes_with(marker)) >= 2
    sandbox.destroy()
    assert host_processes_with(marker) == []
    assert eventfds(daemon.proc.pid) <= eventfds_before
    with pytest.raises(grpc.RpcError) as err:
        stub.ListKernels(kpb.ListKernelsRequest(sandbox_id=sandbox.id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_kernel_talks_over_unix_sockets_in_the_run_dir(daemon, stub, sandbox, kernel) -> None:
    """The connection file asks for the ipc transport in the run directory, the five channel
    sockets are Unix sockets there, and the daemon holds no TCP connection to reach them.

    ipykernel itself always listens on one loopback TCP port, inside the sandbox's network
    namespace: the pipe through which forked children (multiprocessing) send their output, guarded
    by a random token. That one is allowed; nothing else, and no TCP connection at all."""
    listing = sandbox.exec(
        [
            "python3",
            "-c",
            (
                "import json, os, stat, glob\n"
                "(path,) = glob.glob('/run/corral/k*/k.json')\n"
                "info = json.load(open(path))\n"
                "ports = [info[k] for k in ('shell_port', 'iopub_port', 'stdin_port', 'control_port', 'hb_port')]\n"
                "socks = [stat.S_ISSOCK(os.stat(f\"{info['ip']}-{p}\").st_mode) for p in ports]\n"
                "print(json.dumps({'transport': info['transport'], 'ip': info['ip'], 'sockets': socks}))"
            ),
        ],
        check=True,
    )
    info = json.loads(listing.stdout)
    assert info["transport"] == "ipc" and info["ip"].startswith("/run/corral/")
    assert info["sockets"] == [True] * 5
    loopback_listen = ["tcp", "0A", "0100007F"]
    namespace: dict = {}
    exec(SOCKETS_OF, namespace)
    # The daemon's one inet socket is its LLM gateway's listener on the node's loopback
    # (rollout.gateway_listen): a listening socket, not a way to the kernel. No TCP connection.
    daemon_inet = namespace["sockets_of"](daemon.proc.pid)["inet"]
    assert all([table, state, local.split(":")[0]] == loopback_listen for table, state, local in daemon_inet)
    assert len(daemon_inet) <= 1
    held = json.loads(run(stub, kernel, SOCKETS_OF + "print(json.dumps(sockets_of('self')))").stdout)
    assert held["unix"] >= 5
    assert all([table, state, local.split(":")[0]] == loopback_listen for table, state, local in held["inet"])
    assert len(held["inet"]) <= 1


# Lists the sockets a process holds, by inode, against its network namespace's tables.
SOCKETS_OF = r"""
import json, os, re
def sockets_of(pid):
    held = set()
    for fd in os.listdir(f'/proc/{pid}/fd'):
        try:
            m = re.fullmatch(r'socket:\[(\d+)\]', os.readlink(f'/proc/{pid}/fd/{fd}'))
        except OSError:
            continue
        if m:
            held.add(m.group(1))
    def rows(table):
        try:
            return [line.split() for line in open(f'/proc/{pid}/net/{table}').read().splitlines()[1:]]
        except FileNotFoundError:
            return []
    unix = sum(1 for r in rows('unix') if r[6] in held)
    inet = [(t, r[3], r[1]) for t in ('tcp', 'tcp6', 'udp', 'udp6') for r in rows(t) if r[9] in held]
    return {'unix': unix, 'inet': inet}
"""


def test_kernels_work_without_namespaces(tmp_path):
    """isolation = "none": the kernel is the spawned process itself (no launcher in between), run as
    the sandbox uid on the host; cells, timeouts, interrupts and restarts behave the same."""
    require_backend("local")
    config = tmp_path / "none.toml"
    config.write_text('[local]\nisolation = "none"\nallow_no_isolation = true\n')
    for parent in [tmp_path, *tmp_path.parents]:  # the sandbox uid walks the host's real paths
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o011)
    d = DaemonProcess(tmp_path, "--config", str(config)).start()
    try:
        with Client(d.address) as c, c.create_sandbox() as sb, grpc.insecure_channel(f"unix:{d.socket}") as channel:
            stub = kernel_pb2_grpc.KernelServiceStub(channel)
            kernel = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sb.id), timeout=60).kernel
            run(stub, kernel, "kept = 7")
            reply = run(stub, kernel, "import time\ntime.sleep(60)", timeout_ms=300)
            assert reply.done.timed_out and not reply.done.kernel_died
            assert run(stub, kernel, "kept * 6").result.data["text/plain"] == b"42"
            assert run(stub, kernel, "import os\nos._exit(3)").done.kernel_died
            after = run(stub, kernel, "'kept' in dir()")
            assert after.done.restarted and after.result.data["text/plain"] == b"False"
    finally:
        assert d.stop() == 0


def test_gathered_output_is_capped_keeping_head_and_tail():
    """Unit test of the gathering step: a cell that prints far more than the cap keeps its start
    and its end, and says it was truncated."""
    import asyncio

    from corral.daemon.kernel_events import CellDone, StreamOutput, gather

    async def events():
        yield StreamOutput("stdout", "START\n")
        for _ in range(1000):
            yield StreamOutput("stdout", "x" * 1000)
        yield StreamOutput("stdout", "\nEND\n")
        yield StreamOutput("stderr", "warn\n")
        yield CellDone(1, False, False, False, 5)

    cell = asyncio.run(gather(events(), 4096))
    assert cell.truncated and len(cell.stdout) == 4096
    assert cell.stdout.startswith("START\n") and cell.stdout.endswith("\nEND\n")
    assert cell.stderr == "warn\n" and cell.done.execution_count == 1


# -- output caps ----------------------------------------------------------------------------------

CAP = 1 << 20  # the daemon's default output limit: these daemons run with the default
# 3000 lines of 1000 bytes, then a marker: three times the cap.
BIG_STDOUT = (
    "import sys\nprint('START')\nfor i in range(3000): sys.stdout.write(str(i).rjust(999) + '\\n')\nprint('END')"
)
BIG_STDOUT_BYTES = 6 + 3000 * 1000 + 4


@pytest.mark.above_backend
def test_gathered_output_over_the_cap_is_cut_in_the_middle_and_counted(stub, kernel):
    """Head and tail are kept, and the result says how much there was; a cut never leaves half a
    character (stderr here is two-byte characters cut at an odd place)."""
    reply = run(stub, kernel, BIG_STDOUT + "\nsys.stderr.write('é' * 700_001)")
    assert reply.truncated and reply.done.truncated
    assert reply.done.stdout_total_bytes == BIG_STDOUT_BYTES
    assert reply.done.stderr_total_bytes == 1_400_002
    assert len(reply.stdout.encode()) == CAP
    assert reply.stdout.startswith("START\n") and reply.stdout.endswith(" 2999\nEND\n")
    assert set(reply.stderr) == {"é"} and CAP - 2 <= len(reply.stderr.encode()) <= CAP
    small = run(stub, kernel, "print('small')")
    assert not small.truncated and not small.done.truncated
    assert (small.done.stdout_total_bytes, small.done.stderr_total_bytes) == (6, 0)


@pytest.mark.above_backend
def test_streamed_output_stops_at_the_cap_and_done_counts_the_rest(stub, kernel):
    """Execute forwards each stream up to the cap, so a slow reader cannot make the daemon hold
    more; the done event says it was truncated and how much was printed."""
    events = list(stream(stub, kernel, BIG_STDOUT + "\nprint('err', file=sys.stderr)"))
    texts = {kpb.STREAM_NAME_STDOUT: "", kpb.STREAM_NAME_STDERR: ""}
    for event in events:
        if event.HasField("stream"):
            texts[event.stream.name] += event.stream.text
    done = events[-1].done
    assert len(texts[kpb.STREAM_NAME_STDOUT].encode()) == CAP and texts[kpb.STREAM_NAME_STDOUT].startswith("START\n")
    assert texts[kpb.STREAM_NAME_STDERR] == "err\n"  # each stream has its own cap
    assert done.truncated and done.stdout_total_bytes == BIG_STDOUT_BYTES and done.stderr_total_bytes == 4
    assert run(stub, kernel, "'after'").result.data["text/plain"] == b"'after'"


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.above_backend
def test_a_cell_printing_a_gigabyte_leaves_the_daemon_small_and_counts_it_exactly(daemon, stub, kernel):
    """The kernel's output governor holds back all but each stream's head and tail, so the daemon
    neither holds the flood (it once peaked past 1 GiB for 3 GB printed) nor loses count of it
    (iopub dropped most messages: 459 MB were reported of 3 GB)."""
    code = (
        "import sys\nsys.stdout.write('START')\nfor i in range(1000): sys.stdout.write(str(i).rjust(1_000_000))\n"
        "sys.stdout.write('END')"
    )
    before = peak = rss_mib(daemon.proc.pid)
    sampling = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not sampling.is_set():
            peak = max(peak, rss_mib(daemon.proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        reply = run(stub, kernel, code, timeout_ms=120_000)
    finally:
        sampling.set()
        sampler.join()
    assert reply.done.stdout_total_bytes == 1_000_000_008 and reply.truncated
    assert reply.stdout.startswith("START ") and reply.stdout.endswith(" 999END")
    assert len(reply.stdout.encode()) == CAP
    assert peak - before < 150, f"the daemon grew from {before} MiB to {peak} MiB"
    assert run(stub, kernel, "'after'").result.data["text/plain"] == b"'after'"


def peak_rss_while(pids: list[int], call):
    """(call's result, the peak RSS in MiB of each process in `pids` while it ran)."""
    peaks = [rss_mib(pid) for pid in pids]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            for i, pid in enumerate(pids):
                with contextlib.suppress(OSError, StopIteration):
                    peaks[i] = max(peaks[i], rss_mib(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        return call(), peaks
    finally:
        sampling.set()
        sampler.join()


BIG_VALUE = "x = 'START' + 'y' * 200_000_000 + 'END'\nx"


@pytest.mark.above_backend
def test_a_200_mb_value_is_cut_in_the_kernel_and_leaves_the_daemon_small(daemon, stub, kernel):
    """A cell whose value is a 200 MB string: the kernel cuts it before sending (both ends of the
    output cap, the total), so the daemon stays small and the call does not fail on gRPC's message
    limit (it grew by 570 MiB, 950 MiB when streamed, and failed RESOURCE_EXHAUSTED); the same
    for an error whose message is 200 MB, and a 200 MB display is dropped in the kernel."""
    before = rss_mib(daemon.proc.pid)
    reply, (peak,) = peak_rss_while([daemon.proc.pid], lambda: run(stub, kernel, BIG_VALUE, timeout_ms=120_000))
    text = reply.result.data["text/plain"]
    assert text.startswith(b"'STARTyyy") and text.endswith(b"yyyEND'") and len(text) == CAP
    assert reply.result.truncated and reply.result.total_bytes == 200_000_010
    assert reply.truncated and reply.done.truncated and not reply.done.failed
    assert peak - before < 100, f"the daemon grew from {before} MiB to {peak} MiB"
    streamed, (peak,) = peak_rss_while([daemon.proc.pid], lambda: list(stream(stub, kernel, "x")))
    (result,) = [e.result for e in streamed if e.WhichOneof("event") == "result"]
    assert result.truncated and result.total_bytes == 200_000_010 and len(result.data["text/plain"]) == CAP
    assert streamed[-1].done.truncated
    assert peak - before < 100, f"the daemon grew from {before} MiB to {peak} MiB"
    error, (peak,) = peak_rss_while(
        [daemon.proc.pid], lambda: run(stub, kernel, "raise ValueError(x)\n", timeout_ms=120_000)
    )
    assert error.error.ename == "ValueError" and error.error.truncated and len(error.error.evalue) == CAP
    assert error.error.evalue.startswith("STARTyyy") and error.error.evalue.endswith("yyyEND")
    assert error.error.total_bytes > 400_000_000 and error.truncated
    assert peak - before < 100, f"the daemon grew from {before} MiB to {peak} MiB"
    # A 200 MB display, past the displays' cap on its own: dropped in the kernel, counted.
    shown, (peak,) = peak_rss_while(
        [daemon.proc.pid],
        lambda: run(stub, kernel, "from IPython.display import display\ndisplay({'text/plain': x}, raw=True)\n"),
    )
    assert list(shown.displays) == [] and shown.done.displays_dropped == 1 and shown.truncated
    assert peak - before < 100, f"the daemon grew from {before} MiB to {peak} MiB"
    assert run(stub, kernel, "len(x)").result.data["text/plain"] == b"200000008"


# -- death ----------------------------------------------------------------------------------------


@pytest.mark.above_backend
def test_a_cell_that_calls_exit_reports_the_kernel_died_with_its_exit_code(daemon, stub, kernel):
    """exit() makes ipykernel reply (status ok) and then stop: the cell says the kernel died, not
    ok; the next cell restarts it, saying why. The daemon's log states the status, not ipykernel's
    banner."""
    reply = run(stub, kernel, "print('bye')\nexit()")
    assert reply.stdout == "bye\n" and not reply.HasField("error")
    assert reply.done.kernel_died and (reply.done.exit_code, reply.done.signal) == (0, 0)
    assert state_of(stub, kernel) == kpb.KERNEL_STATE_DEAD
    after = run(stub, kernel, "1")
    assert after.done.restarted and after.done.restart_reason == "exit code 0"
    log = daemon.log.read_text()
    assert f"kernel {kernel.kernel_id} in {kernel.sandbox_id} died: exit code 0" in log
    assert f"kernel {kernel.kernel_id} in {kernel.sandbox_id} restarted for a cell (it had died: exit code 0)" in log
    assert "Ctrl-C will not work" not in log  # ipykernel's banner
    quit_reply = run(stub, kernel, "quit()")
    assert quit_reply.done.kernel_died and quit_reply.done.exit_code == 0


@pytest.mark.above_backend
def test_exit_keeping_the_kernel_and_sys_exit_are_not_deaths(stub, kernel):
    """What stays true: exit(True) asks IPython to keep the kernel, and sys.exit() raises
    SystemExit, which IPython catches (the cell fails, the kernel goes on). Neither is reported as
    a death that did not happen."""
    kept = run(stub, kernel, "exit(True)")
    assert not kept.done.kernel_died and state_of(stub, kernel) == kpb.KERNEL_STATE_IDLE
    raised = run(stub, kernel, "import sys\nsys.exit(3)")
    assert raised.done.failed and not raised.done.kernel_died
    assert (raised.error.ename, raised.error.evalue) == ("SystemExit", "3")
    assert run(stub, kernel, "'alive'").result.data["text/plain"] == b"'alive'"


def test_a_dead_kernel_says_its_exit_code_or_signal(stub, sandbox):
    for code, exit_code, sig in [
        ("import os\nos._exit(3)", 3, 0),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", 137, 9),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", 143, 15),
    ]:
        kernel = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id), timeout=60).kernel
        done = run(stub, kernel, code).done
        assert done.kernel_died and (done.exit_code, done.signal, done.oom_killed) == (exit_code, sig, False), code
        cause = f"killed by signal {sig}" if sig else f"exit code {exit_code}"
        assert run(stub, kernel, "1").done.restart_reason == cause
        stub.ShutdownKernel(kpb.ShutdownKernelRequest(sandbox_id=sandbox.id, kernel_id=kernel.kernel_id))


def test_a_kernel_killed_for_memory_says_oom_killed(daemon, stub, client):
    with client.create_sandbox(memory_bytes=256 << 20) as sb:
        memory = next(s for s in sb.info.limit_status if s.kind == "memory")
        if not memory.enforced:
            pytest.skip(f"memory limit not enforced here: {memory.reason}")
        kernel = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sb.id), timeout=60).kernel
        run(stub, kernel, "small = bytearray(1 << 20)")
        done = run(stub, kernel, "hog = b'x' * (1 << 30)").done
        assert done.kernel_died and done.oom_killed and (done.signal, done.exit_code) == (9, 137)
        after = run(stub, kernel, "'small' in dir()")
        assert after.done.restarted and after.done.restart_reason == "killed by signal 9, out of memory"
        assert after.result.data["text/plain"] == b"False"
        assert f"kernel {kernel.kernel_id} in {sb.id} died: killed by signal 9, out of memory" in daemon.log.read_text()


# A thread the cell leaves behind kills the kernel after the cell's result. (The pause: a message
# flushed right before os._exit can die in the kernel's own zmq thread.)
DIES_AFTER_THE_CELL = (
    "import os, threading, time\n"
    "threading.Timer(0.3, lambda: (print('dying', flush=True), time.sleep(0.5), os._exit(7))).start()"
)


@pytest.mark.above_backend
def test_a_kernel_that_dies_between_cells_is_restarted_by_the_next_cell(stub, kernel, client):
    """The next cell restarts the kernel and runs; its result says so and why the kernel had died,
    with what the thread printed first as late output."""
    with cpu_load(client):
        run(stub, kernel, "state = 1")
        assert not run(stub, kernel, DIES_AFTER_THE_CELL).done.kernel_died
        wait_for_state(stub, kernel, kpb.KERNEL_STATE_DEAD)
        reply = run(stub, kernel, "print('runs')\n'state' in dir()")
    assert reply.done.restarted and reply.done.restart_reason == "exit code 7" and not reply.done.kernel_died
    assert reply.stdout == "runs\n" and reply.result.data["text/plain"] == b"False"
    assert reply.done.execution_count == 1 and reply.late_output.stdout == "dying\n"


@pytest.mark.above_backend
def test_a_kernel_that_dies_between_cells_is_reported_by_the_next_cell_without_auto_restart(stub, sandbox, client):
    """Without auto_restart the next cell does not run; its result says the kernel died and why,
    with what the thread printed first; later cells are refused."""
    kernel = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id, auto_restart=False), timeout=60).kernel
    with cpu_load(client):
        assert not run(stub, kernel, DIES_AFTER_THE_CELL).done.kernel_died
        wait_for_state(stub, kernel, kpb.KERNEL_STATE_DEAD)
        reply = run(stub, kernel, "print('never runs')")
    assert reply.done.kernel_died and (reply.done.exit_code, reply.done.signal) == (7, 0)
    assert reply.done.execution_count == 0 and reply.stdout == "" and not reply.done.restarted
    assert reply.late_output.stdout == "dying\n"
    with pytest.raises(grpc.RpcError) as err:
        run(stub, kernel, "1")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "is dead (exit code 7)" in err.value.details()


# -- late output ------------------------------------------------------------------------------------

# The thread writes its line in one write: print() writes the text and its newline separately,
# and the child's line (captured from fd 1 by the kernel's own thread) may land between the two.
LATE_THREAD = (
    "import sys, threading, time\n"
    "def later():\n"
    "    time.sleep(0.3)\n"
    "    sys.stdout.write('from a thread\\n')\n"
    "    sys.stdout.flush()\n"
    "threading.Thread(target=later).start()\n"
)
LATE_CHILD = "import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 0.3; echo from a child; echo child err >&2'])\n"


@pytest.mark.above_backend
def test_output_after_a_cell_finished_reaches_the_next_cell(stub, kernel, client):
    """A thread and a child process print after their cell's result: the next cell's result has
    that apart from its own output (gathered: late_output; streamed: a first late_output event)."""
    with cpu_load(client):
        first = run(stub, kernel, LATE_THREAD + LATE_CHILD + "print('own')")
        assert first.stdout == "own\n" and not first.HasField("late_output")
        time.sleep(2)
        second = run(stub, kernel, "print('second')")
        assert second.stdout == "second\n"
        assert sorted(second.late_output.stdout.splitlines()) == ["from a child", "from a thread"]
        assert second.late_output.stderr == "child err\n" and not second.late_output.truncated
        assert second.late_output.stdout_total_bytes == len("from a thread\nfrom a child\n")
        assert not run(stub, kernel, "1").HasField("late_output")  # delivered once

        run(stub, kernel, LATE_THREAD)
        time.sleep(2)
        events = list(stream(stub, kernel, "print('third')"))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["late_output", "stream", "done"]
    assert events[0].late_output.stdout == "from a thread\n" and events[1].stream.text == "third\n"


@pytest.mark.above_backend
def test_late_output_is_capped_keeping_head_and_tail(stub, kernel):
    code = (
        "import threading, time, sys\n"
        "def later():\n"
        "    time.sleep(0.3)\n"
        "    sys.stdout.write('HEAD\\n' + 'x' * 3_000_000 + '\\nTAIL\\n')\n"
        "    sys.stdout.flush()\n"
        "threading.Thread(target=later).start()\n"
    )
    run(stub, kernel, code)
    time.sleep(3)
    late = run(stub, kernel, "1").late_output
    assert late.truncated and late.stdout_total_bytes == 3_000_011
    assert len(late.stdout.encode()) == CAP and late.stdout.startswith("HEAD\n") and late.stdout.endswith("\nTAIL\n")


@pytest.mark.above_backend
def test_the_rest_of_an_abandoned_cell_reaches_the_next_cell(stub, kernel):
    """A streamed cell whose caller went away is interrupted; what it prints then and its
    KeyboardInterrupt come with the next cell instead of vanishing."""
    code = (
        # 'started' is printed inside the try: an interrupt that comes right after it (the caller
        # goes away at once) still lands in the handler.
        "import time\ntry:\n    print('started', flush=True)\n    time.sleep(60)\n"
        "except KeyboardInterrupt:\n    print('interrupted')\n    raise"
    )
    events = stream(stub, kernel, code)
    assert next(events).stream.text == "started\n"
    events.cancel()
    reply = run(stub, kernel, "'next'", timeout_ms=10_000)
    assert reply.result.data["text/plain"] == b"'next'" and reply.stdout == ""
    assert reply.late_output.stdout == "interrupted\n"
    assert [e.ename for e in reply.late_output.errors] == ["KeyboardInterrupt"]


# -- invalid requests -----------------------------------------------------------------------------


@pytest.mark.above_backend
def test_invalid_kernel_requests_are_invalid_argument_and_leave_nothing(stub, sandbox):
    marker = f"CORRAL_TEST_{uuid.uuid4().hex}"
    invalid = [
        {"python": "python3\0"},
        {"python": "A=B"},  # `env` would take it for a variable
        {"python": "-c"},  # ... and this for an option
        {"python": "  "},
        {"cwd": "relative/dir"},
        {"cwd": "/tmp\0"},
        {"env": {"A=B": "1"}},
        {"env": {"": "1"}},
        {"env": {"A\0": "1"}},
        {"env": {"A": "1\0"}},
    ]
    for fields in invalid:
        env = {marker: "1", **fields.pop("env", {})}
        with pytest.raises(grpc.RpcError) as err:
            stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id, env=env, **fields), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, env)
    assert stub.ListKernels(kpb.ListKernelsRequest(sandbox_id=sandbox.id)).kernels == []
    assert host_processes_with(marker) == []
    left = sandbox.exec(["ls", "-A", "/run/corral"], check=True).stdout.decode().split()
    assert [name for name in left if name.startswith("k")] == []

    kernel = stub.StartKernel(kpb.StartKernelRequest(sandbox_id=sandbox.id), timeout=60).kernel
    for call in (lambda req: run(stub, kernel, **req), lambda req: list(stream(stub, kernel, **req))):
        for request in ({"code": "a\0b"}, {"code": "1", "timeout_ms": 10**12}):
            with pytest.raises(grpc.RpcError) as err:
                call(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
    assert run(stub, kernel, "1").done.execution_count == 1  # nothing of those reached the kernel


# -- helpers for the tests above ------------------------------------------------------------------


def wait_for_state(stub, kernel: kpb.KernelInfo, state: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while state_of(stub, kernel) != state:
        assert time.monotonic() < deadline, f"kernel never reached state {state}"
        time.sleep(0.05)


@contextlib.contextmanager
def cpu_load(client, sandboxes: int = 2):
    """Busy loops in other sandboxes of the same daemon while the block runs."""
    loaders = [client.create_sandbox() for _ in range(sandboxes)]
    threads = [
        threading.Thread(target=_swallow, args=(sb.exec, "while :; do :; done"), kwargs={"timeout": 120}, daemon=True)
        for sb in loaders
    ]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for sb in loaders:
            sb.destroy()
        for thread in threads:
            thread.join(30)


def _swallow(call, *args, **kwargs) -> None:
    with contextlib.suppress(Exception):
        call(*args, **kwargs)
