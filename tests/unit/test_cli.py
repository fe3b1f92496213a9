"""The `corral` command line against a daemon in this process on the fake backend (no root): the
CLI runs as a child process (`python -m corral.cli`), as a user runs it, with real pipes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.cli.main import build_parser
from corral.cli.sandbox_commands import memory_size, split_exec_command
from corral.daemon.config import load_config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import fake_backends
from corral.sdk import AsyncClient, AsyncSandbox
from corral.sdk.tasks import task_to_json
from tests.rollout_tasks import call, repair_task

# The daemon's own default command timeout in these tests: what `corral exec` without --timeout gets.
DAEMON_DEFAULT_TIMEOUT_S = 3.0


@pytest.fixture
async def address() -> AsyncIterator[str]:
    config = load_config(environ={})
    config = dataclasses.replace(
        config, exec=dataclasses.replace(config.exec, default_timeout_s=DAEMON_DEFAULT_TIMEOUT_S)
    )
    async with embedded_daemon(config, backend_classes=fake_backends()) as address:
        yield address


@pytest.fixture
async def sandbox(address) -> AsyncIterator[AsyncSandbox]:
    async with AsyncClient(address) as client, client.create_sandbox() as sandbox:
        yield sandbox


async def corral(*args: str, stdin: bytes | None = None, address: str | None = None) -> tuple[int, bytes, bytes]:
    """Runs `corral ARGS` (with --address first when given) and returns (exit status, stdout, stderr)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("CORRAL_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "corral.cli",
        *(["--address", address] if address else []),
        *args,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, out, err


async def test_exec_options_after_the_id_are_corrals_and_the_command_follows_the_dashes(address, sandbox) -> None:
    await sandbox.write_file("sub/keep", "")
    code, out, err = await corral(
        "exec", sandbox.id, "--cwd", "sub", "--", "sh", "-c", "pwd; echo $0 -- x", address=address
    )
    assert (code, out, err) == (0, f"{sandbox.info.workdir}/sub\nsh -- x\n".encode(), b"")
    code, out, _ = await corral("exec", sandbox.id, "--", "sh", "-c", "exit 3", address=address)
    assert code == 3
    code, out, _ = await corral("exec", "--shell", sandbox.id, "--", "echo $((1 + 2))", address=address)
    assert (code, out) == (0, b"3\n")


async def test_exec_forwards_stdin_with_i(address, sandbox) -> None:
    """As with docker and kubectl exec, -i forwards stdin; without it the command's stdin is at EOF
    (so a script whose own stdin is an open pipe does not hang)."""
    code, out, _ = await corral("exec", "-i", sandbox.id, "--", "cat", stdin=b"piped\x00in\n", address=address)
    assert (code, out) == (0, b"piped\x00in\n")
    code, out, _ = await corral("exec", sandbox.id, "--stdin", "--", "wc", "-c", stdin=b"12345", address=address)
    assert (code, out.strip()) == (0, b"5")
    code, out, _ = await corral("exec", sandbox.id, "--", "cat", stdin=b"not read", address=address)
    assert (code, out) == (0, b"")


async def test_exec_without_timeout_takes_the_daemons_default(address, sandbox) -> None:
    code, _, err = await corral("exec", sandbox.id, "--", "sleep", "30", address=address)
    assert code != 0 and b"timed out after 3" in err


async def test_sandbox_create_takes_memory_sizes_with_units(address) -> None:
    code, out, err = await corral("sandbox", "create", "--memory", "1G", address=address)
    assert code == 0, err
    async with AsyncClient(address) as client:
        sandbox = await client.get_sandbox(out.decode().strip())
        assert sandbox.info.limits.memory_bytes == 1 << 30
        await sandbox.destroy()
    code, _, err = await corral("sandbox", "create", "--memory", "lots", address=address)
    assert code == 2 and b"invalid size 'lots'" in err


async def test_drain_waits_until_the_node_is_empty_and_undo_takes_work_again(address) -> None:
    async with AsyncClient(address) as client:
        sandbox = await client.create_sandbox()
        waiting = asyncio.ensure_future(corral("drain", "--wait", address=address))
        while not (await client.node_info()).draining:
            await asyncio.sleep(0.05)
        assert not waiting.done()
        await sandbox.destroy()
        code, out, err = await waiting
        assert code == 0 and out.endswith(b": draining, empty\n"), err
        code, out, _ = await corral("drain", "--undo", address=address)
        assert code == 0 and out.endswith(b": taking new work, empty\n")
        await (await client.create_sandbox()).destroy()


def test_memory_sizes() -> None:
    assert memory_size("1073741824") == 1 << 30
    assert [memory_size(text) for text in ("1G", "1g", "1GiB", "1GB", "1gb")] == [1 << 30] * 5
    assert memory_size("512M") == memory_size("512MiB") == 512 << 20
    assert memory_size("1.5G") == 3 << 29
    assert memory_size("64k") == 64 << 10 and memory_size("100b") == 100
    for bad in ("", "G", "1X", "-1G", "0", "1 G B"):
        with pytest.raises(Exception, match="invalid size"):
            memory_size(bad)


def test_only_exec_splits_at_the_dashes() -> None:
    assert split_exec_command(["exec", "ID", "--cwd", "d", "--", "ls", "--", "-l"]) == (
        ["exec", "ID", "--cwd", "d"],
        ["ls", "--", "-l"],
    )
    assert split_exec_command(["--address", "exec", "sandbox", "rm", "--", "x"]) == (
        ["--address", "exec", "sandbox", "rm", "--", "x"],
        None,
    )
    assert split_exec_command(["exec", "ID", "ls"]) == (["exec", "ID", "ls"], None)


async def test_cp_of_a_missing_local_path_is_an_error_not_a_traceback(address, sandbox, tmp_path: Path) -> None:
    code, _, err = await corral("cp", str(tmp_path / "missing"), f"{sandbox.id}:/w", address=address)
    assert code == 1 and b"missing: no such file or directory" in err and b"Traceback" not in err
    (tmp_path / "present.txt").write_text("x")
    code, _, err = await corral("cp", str(tmp_path / "present.txt"), f"{sandbox.id}:sub", address=address)
    assert code == 0, err
    assert await sandbox.read_file("sub/present.txt") == b"x"


def test_address_help_names_every_source() -> None:
    help_text = " ".join(build_parser().format_help().split())
    assert "$CORRAL_ADDRESS, else $CORRAL_SOCKET, else /run/corral/corral.sock" in help_text


async def test_an_unavailable_daemon_comes_with_a_hint(tmp_path: Path) -> None:
    code, _, err = await corral("sandbox", "ls", address=f"unix://{tmp_path}/absent.sock")
    assert code == 1 and b"absent.sock is unavailable" in err
    assert b"corral serve" in err and b"$CORRAL_ADDRESS" in err and b"Traceback" not in err


async def test_address_may_follow_the_subcommand(address, tmp_path: Path) -> None:
    """As the README writes `corral run TASKS --address ...`; one given there wins."""
    code, out, err = await corral("sandbox", "ls", "--address", address)
    assert (code, out.split()) == (0, [b"ID", b"BACKEND", b"STATE", b"IMAGE"]), err
    code, _, err = await corral("sandbox", "ls", "--address", address, address=f"unix://{tmp_path}/absent.sock")
    assert code == 0, err


# ---- corral run against a daemon that outlives it --------------------------------------------


async def corral_run_until(address: str, tasks: Path, stop: signal.Signals | None) -> tuple[int, bytes]:
    """`corral run TASKS --llm builtin:replay --address ADDRESS`; with `stop`, that signal is sent
    once its built-in server is registered. Returns (exit status, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "corral.cli",
        "run",
        str(tasks),
        "--llm",
        "builtin:replay",
        "--address",
        address,
        "--no-progress",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    if stop is not None:
        async with AsyncClient(address) as client:
            for _ in range(600):
                if await client.rollouts.list_llms():
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("corral run never registered its server")
        await asyncio.sleep(0.5)  # the rollout is under way
        proc.send_signal(stop)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err


@pytest.mark.parametrize("stop", [None, signal.SIGINT, signal.SIGTERM], ids=["finished", "ctrl-c", "sigterm"])
async def test_corral_run_removes_its_builtin_server_from_the_daemon(address, tmp_path: Path, stop) -> None:
    """The built-in reference server stops with `corral run`; a daemon that outlives the command
    must not keep it registered (its next rollout would go to a dead server)."""
    # The slow task runs its RUN stage for a minute, so that the signal finds the rollout running.
    task = (
        repair_task("slow", solution=[call("bash", command="sleep 60"), call("submit")])
        if stop
        else repair_task("quick")
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(task_to_json(task) + "\n")
    code, err = await corral_run_until(address, tasks, stop)
    assert code == {None: 0, signal.SIGINT: 130, signal.SIGTERM: 143}[stop], err.decode()
    assert b"Traceback" not in err
    async with AsyncClient(address) as client:
        assert await client.rollouts.list_llms() == []
