"""The daemon's own logic, without root: managers, request rules, the idle reaper, teardown order,
crash records and the rollout pipeline, on a real daemon in this process (gRPC over a Unix socket)
whose backend is the fake of corral.daemon.testing (host processes as the caller, no isolation).
The real backends are the integration suite's business."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral.cli.run import is_token_exact
from corral.daemon.backends.base import Limits
from corral.daemon.config import Config, load_config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.rules import CommandRequest
from corral.daemon.server import Daemon
from corral.daemon.testing import FakeBackend, FakeSandbox, fake_backends, marked_pids
from corral.sdk import (
    AsyncClient,
    ExecExited,
    ExecOutput,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    load_tasks,
)
from tests.rollout_tasks import repair_task, replay_server

ROOT = Path(__file__).resolve().parents[2]


def config_in(tmp_path: Path, **limits: Any) -> Config:
    config = load_config(environ={})
    return dataclasses.replace(
        config,
        daemon=dataclasses.replace(
            config.daemon, socket=str(tmp_path / "corral.sock"), state_dir=str(tmp_path / "state"), max_sandboxes=3
        ),
        limits=dataclasses.replace(config.limits, **limits),
    )


@pytest.fixture
async def daemon(tmp_path) -> AsyncIterator[Daemon]:
    """The daemon object itself (for checks on its managers), started on a socket of its own."""
    daemon = Daemon(config_in(tmp_path), backend_classes=fake_backends())
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop()


@pytest.fixture
async def client(daemon) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"unix://{daemon.socket_path}") as client:
        yield client


async def test_sandboxes_are_created_listed_and_destroyed(client, daemon) -> None:
    sandbox = await client.create_sandbox(labels={"job": "a"})
    other = await client.create_sandbox(labels={"job": "b"})
    assert sandbox.info.state == "running" and sandbox.info.isolation == "none"
    assert [s.id for s in await client.list_sandboxes(labels={"job": "a"})] == [sandbox.id]
    result = await sandbox.exec("echo out; echo err >&2; exit 3", timeout=10)
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    records = sorted(path.stem for path in (daemon.state.records_dir).glob("*.json"))
    assert records == sorted([sandbox.id, other.id])
    await sandbox.destroy()
    await other.destroy()
    assert await client.list_sandboxes() == []
    assert not list(daemon.state.records_dir.glob("*.json"))
    with pytest.raises(NotFound):
        await client.get_sandbox(sandbox.id)


async def test_request_rules_refuse_the_callers_mistakes(client) -> None:
    sandbox = await client.create_sandbox()
    with pytest.raises(InvalidArgument, match=r"timeout_ms must be 1\.\.86400000 ms"):
        await sandbox.exec(["true"], timeout=10**7)
    with pytest.raises(InvalidArgument, match="environment"):
        await sandbox.exec(["true"], env={"A=B": "x"})
    with pytest.raises(InvalidArgument, match="NUL"):
        await sandbox.exec("echo a\0b")
    with pytest.raises(InvalidArgument, match=r"limits.memory_bytes must be 4194304\.\."):
        await client.create_sandbox(memory_bytes=1024)
    with pytest.raises(FailedPrecondition, match="not configured"):
        await client.create_sandbox(backend="docker")
    shell = await sandbox.shell()
    with pytest.raises(InvalidArgument, match=r"timeout_ms must be 1\.\.86400000 ms"):
        await shell.run("true", timeout=10**7)
    with pytest.raises(InvalidArgument, match="shell name"):
        await sandbox.shell("a/b")
    with pytest.raises(NotFound):
        await client.get_sandbox("sb-nosuchsandbox")


async def test_exec_cwd_is_relative_to_the_workdir_and_must_be_a_directory(client) -> None:
    """A relative cwd resolves against the workdir, as file paths do; a missing one (or a file) is
    FAILED_PRECONDITION naming the path, not a command that fails to start."""
    async with client.create_sandbox() as sandbox:
        workdir = sandbox.info.workdir
        await sandbox.write_file("sub/file.txt", "x")
        assert (await sandbox.exec(["pwd"], cwd="sub", timeout=10)).stdout == f"{workdir}/sub\n".encode()
        events = [event async for event in sandbox.exec_stream(["pwd"], cwd="sub/", timeout=10)]
        assert ExecOutput("stdout", f"{workdir}/sub\n".encode()) in events
        with pytest.raises(FailedPrecondition, match=f"cwd {workdir}/missing does not exist"):
            await sandbox.exec(["pwd"], cwd="missing", timeout=10)
        with pytest.raises(FailedPrecondition, match=f"cwd {workdir}/sub/file.txt is not a directory"):
            await sandbox.exec(["pwd"], cwd=f"{workdir}/sub/file.txt", timeout=10)
        with pytest.raises(FailedPrecondition, match="cwd /no/such/dir does not exist"):
            async with sandbox.exec_stream(["pwd"], cwd="/no/such/dir", timeout=10) as stream:
                [event async for event in stream]


async def test_exec_without_a_timeout_takes_the_daemons_default(tmp_path) -> None:
    """The SDK leaves an unset command timeout to the daemon's exec.default_timeout_s."""
    config = config_in(tmp_path)
    config = dataclasses.replace(config, exec=dataclasses.replace(config.exec, default_timeout_s=0.5))
    daemon = Daemon(config, backend_classes=fake_backends())
    await daemon.start()
    try:
        async with AsyncClient(f"unix://{config.daemon.socket}") as client, client.create_sandbox() as sandbox:
            result = await sandbox.exec("sleep 30")
            assert result.timed_out and result.duration_ms < 10_000
            events = [event async for event in sandbox.exec_stream("sleep 30")]
            assert isinstance(events[-1], ExecExited) and events[-1].timed_out
    finally:
        await daemon.stop()


async def test_the_sandbox_limit_is_resource_exhausted(client) -> None:
    for _ in range(3):
        await client.create_sandbox()
    with pytest.raises(ResourceExhausted, match="max_sandboxes"):
        await client.create_sandbox()


async def test_a_timeout_kills_the_whole_tree_while_other_sandboxes_load_the_cpu(client) -> None:
    loaders = [await client.create_sandbox() for _ in range(2)]
    burners = [
        asyncio.create_task(sb.exec("while :; do :; done", timeout=5))
        for sb in loaders  # two busy cores' worth
    ]
    sandbox = await client.create_sandbox()
    started = time.monotonic()
    result = await sandbox.exec("echo before; (sleep 300; echo never) & sleep 300", timeout=1)
    assert result.timed_out and result.stdout == b"before\n"
    assert time.monotonic() - started < 5
    after = await sandbox.exec("echo still usable", timeout=10)
    assert after.stdout == b"still usable\n"
    for task in burners:
        assert (await task).timed_out


async def test_the_idle_reaper_spares_busy_sandboxes_and_destroys_idle_ones(client) -> None:
    idle = await client.create_sandbox(idle_timeout=1)
    busy = await client.create_sandbox(idle_timeout=1)
    result = await busy.exec("sleep 3; echo done", timeout=10)  # a call in flight keeps it alive
    assert result.stdout == b"done\n"
    listed = {s.id for s in await client.list_sandboxes()}
    assert idle.id not in listed and busy.id in listed
    await asyncio.sleep(2.5)
    assert busy.id not in {s.id for s in await client.list_sandboxes()}


async def test_destroy_closes_sessions_first_then_kills_every_process_and_removes_the_files(client, daemon) -> None:
    sandbox = await client.create_sandbox()
    shell = await sandbox.shell()
    await shell.run("sleep 1000 >/dev/null 2>&1 &", timeout=10)
    await sandbox.exec("setsid sleep 1001 >/dev/null 2>&1 &", timeout=10)
    workspace = Path(sandbox.info.workdir)
    await sandbox.write_file("kept.txt", "x")
    # The shell and both sleeps; the setsid one may still be on its way (setsid forks first).
    deadline = time.monotonic() + 10
    while len(marked_pids(sandbox.id)) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (workspace / "kept.txt").exists() and len(marked_pids(sandbox.id)) >= 3

    seen: list[tuple[str, bool, int]] = []

    async def hook(sandbox_id: str) -> None:
        # Runs before the runtime goes: the sandbox is still alive and its shell still open.
        runtime = daemon.manager.get(sandbox_id).runtime
        seen.append((sandbox_id, runtime is not None and runtime.alive(), len(daemon.shells.list(sandbox_id))))

    daemon.manager.on_destroy(hook)
    await sandbox.destroy()
    assert seen == [(sandbox.id, True, 0)]  # the shell manager's own hook, registered first, closed it
    assert marked_pids(sandbox.id) == set()
    assert not workspace.exists() and not (daemon.state.records_dir / f"{sandbox.id}.json").exists()


class _FailingLaunch(FakeSandbox):
    async def launch(self) -> None:
        await super().launch()
        raise FailedPrecondition("the launcher failed on purpose")


class _FailingBackend(FakeBackend):
    sandbox_class = _FailingLaunch


async def test_a_failed_create_leaves_nothing_behind(tmp_path) -> None:
    daemon = Daemon(config_in(tmp_path), backend_classes={"local": _FailingBackend})
    await daemon.start()
    try:
        with pytest.raises(FailedPrecondition, match="on purpose"):
            await daemon.manager.create(
                backend="", image="", limits=Limits(), network=False, env={}, labels={}, idle_timeout_ms=0
            )
        assert len(daemon.manager) == 0
        assert not list(daemon.state.records_dir.glob("*.json"))
        assert not list((tmp_path / "state" / "sandboxes").iterdir())
        run_base = daemon.backends["local"].context.run_base
        assert not (run_base.is_dir() and list(run_base.iterdir()))
    finally:
        await daemon.stop()


async def test_a_restarted_daemon_reaps_what_a_crashed_one_left(tmp_path) -> None:
    first = Daemon(config_in(tmp_path), backend_classes=fake_backends())
    await first.start()
    sandbox = await first.manager.create(
        backend="", image="", limits=Limits(), network=False, env={}, labels={}, idle_timeout_ms=0
    )
    await first.execs.exec(sandbox.sandbox_id, CommandRequest(argv=None, shell="sleep 1002 >/dev/null 2>&1 &"))
    record = json.loads((first.state.records_dir / f"{sandbox.sandbox_id}.json").read_text())
    assert record["backend"] == "local" and Path(record["sandbox_dir"]).is_dir()
    # A crash: the first daemon never tears down (only its server stops, to free the socket; a
    # socket only the daemon's user may open has no front).
    assert first.server is not None and first.front is None
    await first.server.stop(0)
    await first.rollouts.close()
    second = Daemon(config_in(tmp_path), backend_classes=fake_backends())
    await second.start()
    try:
        assert len(second.manager) == 0
        assert not Path(record["sandbox_dir"]).exists()
        assert not list(second.state.records_dir.glob("*.json"))
        assert marked_pids(sandbox.sandbox_id) == set()
    finally:
        await second.stop()


async def test_files_through_the_typed_file_methods(client) -> None:
    sandbox = await client.create_sandbox()
    await sandbox.write_file("src/app.py", b"print(1)\n")
    assert await sandbox.read_file("src/app.py") == b"print(1)\n"
    assert await sandbox.read_file("src/app.py", offset=6, limit=2) == b"1)"
    assert [entry.name for entry in await sandbox.list_dir("src")] == ["app.py"]
    with pytest.raises(NotFound):
        await sandbox.read_file("missing.txt")


async def test_rollouts_run_to_reward_one_through_the_pipeline(tmp_path) -> None:
    tasks = [repair_task(f"fake-{i}") for i in range(3)]
    async with embedded_daemon(config_in(tmp_path), backend_classes=fake_backends()) as address:
        async with AsyncClient(address) as client, replay_server(tasks) as server:
            await client.rollouts.register_llm(server.url)
            results = [result async for result in client.rollouts.stream(tasks)]
            assert await client.list_sandboxes() == []  # every rollout freed its sandbox
    assert sorted(r.task_id for r in results) == ["fake-0", "fake-1", "fake-2"]
    for result in results:
        assert result.status == "completed", result.error
        assert result.reward == 1.0 and is_token_exact(result)
        assert result.timings["init"] > 0 and result.timings["eval"] > 0


async def test_a_bundled_example_task_replays_to_reward_one(tmp_path) -> None:
    tasks = load_tasks(ROOT / "examples" / "tasks" / "repair.jsonl")[:2]
    async with embedded_daemon(config_in(tmp_path), backend_classes=fake_backends()) as address:
        async with AsyncClient(address) as client, replay_server(tasks) as server:
            await client.rollouts.register_llm(server.url)
            results = [result async for result in client.rollouts.stream(tasks)]
    assert [r.status for r in results] == ["completed", "completed"], [r.error for r in results]
    assert all(r.reward == 1.0 for r in results)


async def test_the_node_says_its_backend_is_a_stand_in(client) -> None:
    (local,) = (await client.node_info()).backends
    assert local.available and "FAKE BACKEND" in local.detail and local.isolation == "none"
    assert {limit.kind for limit in local.limits if not limit.enforced} == {"memory", "pids", "cpu", "network"}


def test_sandbox_processes_do_not_inherit_signals_the_daemon_ignored(tmp_path) -> None:
    """A daemon started under nohup (SIGHUP ignored), a supervisor that ignores SIGQUIT, or GNU
    make (glibc's reserved 32 and 33 ignored): the commands, shells and kernels it starts in
    sandboxes get the default dispositions back."""
    import signal
    import subprocess
    import sys

    script = """
import asyncio, signal, sys
signal.signal(signal.SIGHUP, signal.SIG_IGN)
signal.signal(signal.SIGQUIT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
# glibc's own 32 and 33 (which GNU make leaves ignored for its recipes), through the raw call.
import ctypes, platform
if platform.machine() == "x86_64":
    ignore = ctypes.create_string_buffer((1).to_bytes(8, "little") + bytes(56))
    for reserved in (32, 33):
        ctypes.CDLL(None).syscall(ctypes.c_long(13), ctypes.c_long(reserved), ignore, None, ctypes.c_long(8))
    ignored = int(open("/proc/self/status").read().split("SigIgn:")[1].split()[0], 16)
    assert ignored >> 31 & 3 == 3
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import fake_backends
from corral.sdk import AsyncClient

async def main():
    async with embedded_daemon(backend_classes=fake_backends()) as address:
        async with AsyncClient(address) as client:
            sandbox = await client.create_sandbox()
            result = await sandbox.exec(["cat", "/proc/self/status"], timeout=10)
            shell = await sandbox.shell()
            in_shell = await shell.run("grep -E '^Sig(Ign|Blk)' /proc/self/status", timeout=10)
            sys.stdout.write(result.stdout.decode() + in_shell.output.decode())

asyncio.run(main())
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    masks = [int(line.split()[1], 16) for line in run.stdout.splitlines() if line.startswith(("SigIgn", "SigBlk"))]
    assert len(masks) == 4
    for mask in masks:
        for sig in (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, 32, 33):
            assert not mask & (1 << (sig - 1)), f"signal {sig} is ignored or blocked: {run.stdout}"
