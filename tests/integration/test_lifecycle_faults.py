"""Sandbox lifecycle against a real daemon on the local backend, under the faults a busy node
meets: thousands of commands (cgroups reused, not piled up), limits the kernel would refuse,
requests with out-of-range numbers, and a state directory on a full disk. Each test starts its
own daemon and looks only at that daemon's own cgroups, sandboxes and files."""

from __future__ import annotations

import errno
import os
import resource
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from corral.daemon.cgroups import CgroupDriver
from corral.sdk import Client
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import sandbox_pb2_grpc
from tests.conftest import DaemonProcess, require_backend

EXECS = 200


class MetricsDaemon(DaemonProcess):
    metrics_url = ""


@pytest.fixture
def local(tmp_path):
    require_backend("local")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = MetricsDaemon(tmp_path, "--metrics", f"127.0.0.1:{port}").start()
    d.metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        yield d
    finally:
        d.stop()


def _bases(daemon_id: str) -> list[Path]:
    """That daemon's own base directory in every hierarchy it uses (see conftest.cgroup_dirs)."""
    found = []
    for h in CgroupDriver(daemon_id, create=False).hierarchies:
        for base in (h.base, h.base.parent.parent / h.base.name):
            if base.is_dir():
                found.append(base)
                break
    return found


def _dirs_under(daemon_id: str, sandbox_id: str) -> int:
    """cgroup directories of one sandbox: its group and every leaf, in every hierarchy."""
    return sum(
        1 + sum(1 for p in (base / sandbox_id).rglob("*") if p.is_dir())
        for base in _bases(daemon_id)
        if (base / sandbox_id).is_dir()
    )


def _cgroups_held(url: str) -> int:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(int(float(line.split()[-1])) for line in text.splitlines() if line.startswith("corral_cgroups_held{"))


def test_execs_reuse_their_leaf_cgroups(local) -> None:
    with Client(local.address) as c:
        daemon_id = c.node_info().daemon_id
        hierarchies = len(_bases(daemon_id))
        if not hierarchies:
            pytest.skip("this daemon has no cgroups")
        sb = c.create_sandbox(image="host")
        before = _dirs_under(daemon_id, sb.id)
        # A background child keeps its command's leaf busy: later commands must not share it.
        pid = int(sb.exec("sleep 60 >/dev/null 2>&1 & echo $!", timeout=10).stdout)
        for n in range(EXECS):
            if n % 4:
                assert sb.exec(["true"], timeout=10).exit_code == 0
            else:
                assert [type(e).__name__ for e in sb.exec_stream(["true"], timeout=10)][-1] == "ExecExited"
        assert sb.exec(["sleep", "5"], timeout=0.2).timed_out  # kills its own leaf, nothing else
        assert sb.exec(f"kill -0 {pid}", timeout=10).exit_code == 0
        after = _dirs_under(daemon_id, sb.id)
        # Two leaves at most: the busy one and the one every later command reused.
        assert after <= before + 2 * hierarchies, (before, after)
        assert _cgroups_held(local.metrics_url) == after
        sb.destroy()
        assert _cgroups_held(local.metrics_url) == 0


def test_limits_out_of_range_are_invalid_and_leave_no_cgroups(local) -> None:
    with Client(local.address) as c:
        daemon_id = c.node_info().daemon_id
    with grpc.insecure_channel(f"unix:{local.socket}") as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        for limits, field in (
            (pb.ResourceLimits(pids=5_000_000), "limits.pids"),  # pids.max would refuse it
            (pb.ResourceLimits(memory_bytes=2**64 - 1), "limits.memory_bytes"),
            (pb.ResourceLimits(cpu_millicores=2**32 - 1), "limits.cpu_millicores"),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateSandbox(pb.CreateSandboxRequest(image="host", limits=limits), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert caught.value.details().startswith(f"{field} must be ")
        assert list(stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=10).sandboxes) == []
    assert not [p for base in _bases(daemon_id) for p in base.iterdir() if p.is_dir()]


def test_a_huge_idle_timeout_is_invalid_and_listing_still_works(local) -> None:
    with grpc.insecure_channel(f"unix:{local.socket}") as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.CreateSandbox(pb.CreateSandboxRequest(image="host", idle_timeout_ms=2**64 - 2), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "idle_timeout_ms must be 1..2592000000 ms" in caught.value.details()
        assert list(stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=10).sandboxes) == []
        created = stub.CreateSandbox(pb.CreateSandboxRequest(image="host", idle_timeout_ms=600_000), timeout=30)
        listed = stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=10).sandboxes
        assert [s.sandbox_id for s in listed] == [created.sandbox.sandbox_id]
        assert listed[0].idle_timeout_ms == 600_000
        stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=created.sandbox.sandbox_id), timeout=30)


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0711", "tmpfs", str(path)])
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")


def _fill(path: Path) -> Path:
    """Fills the filesystem of `path` with one file; returns it."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_create_on_a_full_state_disk_leaves_nothing(tmp_path) -> None:
    require_backend("local")
    state = tmp_path / "state"
    _mount_tmpfs(state, "1m")
    config = tmp_path / "corral.toml"
    config.write_text("[daemon]\nmax_sandboxes = 1\n")
    d = DaemonProcess(tmp_path, "--config", str(config))
    try:
        d.start()
        filler = _fill(state)
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            for _ in range(2):  # more failures than max_sandboxes
                with pytest.raises(grpc.RpcError) as caught:
                    stub.CreateSandbox(pb.CreateSandboxRequest(image="host"), timeout=30)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
                assert "No space left on device" in caught.value.details()
                sandbox_id = caught.value.details().split()[1]
                assert list(stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=10).sandboxes) == []
                with pytest.raises(grpc.RpcError) as gone:
                    stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox_id), timeout=5)
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            assert not list((state / "records").iterdir())
            filler.unlink()
            created = stub.CreateSandbox(pb.CreateSandboxRequest(image="host"), timeout=30)  # the slot is free
            stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=created.sandbox.sandbox_id), timeout=30)
            _fill(state)
            with pytest.raises(grpc.RpcError):
                stub.CreateSandbox(pb.CreateSandboxRequest(image="host"), timeout=30)
        started = time.monotonic()
        assert d.stop(timeout=20) == 0  # SIGTERM: no creation left to wait for
        assert time.monotonic() - started < 15
    finally:
        if d.proc and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        subprocess.run(["umount", "-l", str(state)])


def test_a_create_out_of_file_descriptors_leaves_nothing(tmp_path) -> None:
    """The daemon's own fd limit lowered to what it has open, plus a few: creates fail at
    different steps (the record, a pipe to the launcher), each with a definite code and nothing
    left behind."""
    require_backend("local")
    d = DaemonProcess(tmp_path).start()
    assert d.proc is not None
    pid = d.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=10)  # the connection is up
            failures = 0
            for margin in (0, 3, 6):
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + margin, hard))
                try:
                    created = stub.CreateSandbox(pb.CreateSandboxRequest(image="host"), timeout=30)
                except grpc.RpcError as err:
                    failures += 1
                    assert err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE), err
                    sandbox_id = err.details().split()[1]
                    with pytest.raises(grpc.RpcError) as gone:
                        stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox_id), timeout=5)
                    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
                else:
                    stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=created.sandbox.sandbox_id), timeout=30)
                finally:
                    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
                assert list(stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=10).sandboxes) == []
            assert failures
            assert not list((d.state_dir / "records").iterdir())
            daemon_id = (d.state_dir / "daemon_id").read_text().strip()
            assert not [p for base in _bases(daemon_id) for p in base.iterdir() if p.is_dir()]
            # What a teardown without file descriptors could not remove goes once they are back.
            deadline = time.monotonic() + 20
            while list((d.state_dir / "sandboxes").iterdir()) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not list((d.state_dir / "sandboxes").iterdir())
        started = time.monotonic()
        assert d.stop(timeout=20) == 0
        assert time.monotonic() - started < 15
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
