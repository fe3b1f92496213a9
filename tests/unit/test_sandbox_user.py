"""`user` and `mounts` end to end, through a real daemon and the SDK on the fake backend (no root):
what the caller sends reaches the backend (the fake echoes, in every program's environment, the
user enter_command was given and the SandboxSpec's mounts: corral.daemon.testing), a bad value is
INVALID_ARGUMENT, a mount outside the allowed roots PERMISSION_DENIED, and a refused create leaves
nothing behind."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.cli.sandbox_commands import bind_mount
from corral.daemon import rules
from corral.daemon.config import load_config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import MOUNTS_ECHO, USER_ECHO, fake_backends
from corral.rollout.evaluation import create_task_sandbox
from corral.sdk import AsyncClient, InvalidArgument, Mount, NotFound, PermissionDenied
from corral.sdk._core import MountSpec
from corral.v1 import rollout_pb2
from tests.unit.test_cli import corral

ECHO_USER = f'printf %s "${USER_ECHO}"'


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    (allowed / "data").mkdir(parents=True)
    return allowed


@pytest.fixture
async def client(tmp_path: Path, roots: Path) -> AsyncIterator[AsyncClient]:
    config = load_config(environ={})
    config = dataclasses.replace(config, sandbox=dataclasses.replace(config.sandbox, bind_roots=[str(roots)]))
    async with embedded_daemon(config, backend_classes=fake_backends()) as address, AsyncClient(address) as client:
        yield client


def test_user_rule() -> None:
    for good in ("", "root", "agent", "www-data", "_svc", "1000", "0:0", "65535:65535"):
        assert rules.user(good) == good
    for bad in ("a b", "-x", "1000:", ":0", "65536", "1:70000", "a\0", "x" * 65, "1:2:3"):
        with pytest.raises(InvalidArgument):
            rules.user(bad)


async def test_the_sandboxs_user_and_each_calls_reach_the_backend(client: AsyncClient) -> None:
    async with client.create_sandbox(user="agent") as sandbox:
        assert sandbox.info.user == "agent"
        assert (await client.get_sandbox(sandbox.id)).info.user == "agent"
        # The sandbox's default, for every kind of call that names no user...
        assert (await sandbox.exec(ECHO_USER)).text == "agent"
        # ...and the call's own user where it names one.
        assert (await sandbox.exec(ECHO_USER, user="0")).text == "0"
        async with sandbox.exec_stream(ECHO_USER, user="1000:1000") as events:
            streamed = b"".join([e.data async for e in events if hasattr(e, "data")])
        assert streamed == b"1000:1000"
        async with await sandbox.shell("default") as shell:
            assert (await shell.run(ECHO_USER)).output == b"agent"
        async with await sandbox.shell("root", user="root") as shell:
            assert (await shell.run(ECHO_USER)).output == b"root"
            # A restarted shell keeps its user.
            assert (await shell.run("kill -9 $$")).shell_restarted
            assert (await shell.run(ECHO_USER)).output == b"root"
        async with await sandbox.kernel(python=sys.executable, user="7") as kernel:
            code = f"import os; print(os.environ['{USER_ECHO}'])"
            assert (await kernel.execute(code)).stdout == "7\n"
            await kernel.restart()
            assert (await kernel.execute(code)).stdout == "7\n"


async def test_no_user_is_the_images_own(client: AsyncClient) -> None:
    async with client.create_sandbox() as sandbox:
        assert sandbox.info.user == ""
        assert (await sandbox.exec(ECHO_USER)).text == ""


async def test_the_cli_takes_user_and_mounts(client: AsyncClient, roots: Path) -> None:
    """`corral sandbox create --user --mount`, `corral exec --user`, and `corral shell --user`
    (an Attach terminal, here fed a script on a pipe)."""
    address = client.address
    code, out, err = await corral(
        "sandbox",
        "create",
        "--user",
        "agent",
        "--mount",
        f"{roots}/data:/data:rw",
        "--mount",
        f"{roots}:/r",
        address=address,
    )
    assert code == 0, err
    sandbox = await client.get_sandbox(out.decode().strip())
    try:
        assert sandbox.info.user == "agent"
        assert sandbox.info.mounts == (Mount(f"{roots}/data", "/data", True), Mount(str(roots), "/r", False))
        code, out, _ = await corral("exec", sandbox.id, "--", "sh", "-c", ECHO_USER, address=address)
        assert (code, out) == (0, b"agent")
        code, out, _ = await corral("exec", "--user", "0:0", sandbox.id, "--", "sh", "-c", ECHO_USER, address=address)
        assert (code, out) == (0, b"0:0")
        script = f'printf "<%s>" "${USER_ECHO}"; exit\n'.encode()
        for flags, expected in (((), b"<agent>"), (("--user", "42"), b"<42>")):
            code, out, err = await corral("shell", *flags, "--program", "sh", sandbox.id, stdin=script, address=address)
            assert code == 0 and expected in out, (out, err)
    finally:
        await sandbox.destroy()
    code, _, err = await corral("sandbox", "create", "--mount", "/etc:/etc", address=address)
    assert code == 1 and f"only under {roots}".encode() in err, err
    code, _, err = await corral("sandbox", "create", "--mount", "nocolon", address=address)
    assert code == 2 and b"invalid mount 'nocolon'" in err
    assert await client.list_sandboxes() == []


def test_mount_flags() -> None:
    assert bind_mount("/h:/s") == Mount("/h", "/s", False)
    assert bind_mount("/h:/s:ro") == Mount("/h", "/s", False)
    assert bind_mount("/h:/s:rw") == Mount("/h", "/s", True)
    for bad in ("/h", "/h:", ":/s", "/h:/s:rx", "/h:/s:rw:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid mount"):
            bind_mount(bad)


async def test_bad_users_are_invalid_argument_on_every_call(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match="user must be"):
        await client.create_sandbox(user="no such user")
    assert await client.list_sandboxes() == []
    async with client.create_sandbox() as sandbox:
        with pytest.raises(InvalidArgument, match="user ids must be below 65536"):
            await sandbox.exec("true", user="70000")
        with pytest.raises(InvalidArgument, match="user must be"):
            async with sandbox.exec_stream("true", user="a:b") as events:
                [event async for event in events]
        with pytest.raises(InvalidArgument, match="user must be"):
            await sandbox.shell(user="-root")
        assert await sandbox.list_shells() == []
        with pytest.raises(InvalidArgument, match="user must be"):
            await sandbox.kernel(python=sys.executable, user="x" * 65)
        assert await sandbox.list_kernels() == []


async def test_mounts_reach_the_backend_checked_and_resolved(client: AsyncClient, roots: Path) -> None:
    (roots / "link").symlink_to(roots / "data")
    mounts: list[MountSpec] = [Mount(f"{roots}/link", "/mnt/data/"), (str(roots), "/mnt", True)]
    async with client.create_sandbox(mounts=mounts) as sandbox:
        expected = (Mount(str(roots), "/mnt", True), Mount(f"{roots}/data", "/mnt/data", False))
        assert sandbox.info.mounts == expected
        assert (await client.get_sandbox(sandbox.id)).info.mounts == expected
        given = json.loads((await sandbox.exec(f'printf %s "${MOUNTS_ECHO}"')).stdout)
        assert given == [[str(roots), "/mnt", False], [f"{roots}/data", "/mnt/data", True]]


async def test_refused_mounts_leave_nothing_behind(client: AsyncClient, roots: Path, tmp_path: Path) -> None:
    refusals = [
        (PermissionDenied, [("/etc", "/data")], f"only under {roots}"),
        (PermissionDenied, [(f"{tmp_path}/nothing-here", "/data")], f"only under {roots}"),
        (NotFound, [(f"{roots}/missing", "/data")], "does not exist"),
        (InvalidArgument, [(f"{roots}/data", "/proc/data")], "reserved"),
        (InvalidArgument, [(f"{roots}/data", "/data"), (f"{roots}/data", "/data")], "same sandbox_path"),
        (InvalidArgument, [(f"{roots}/data", "relative")], "must be absolute"),
    ]
    for error, mounts, message in refusals:
        with pytest.raises(error, match=message):
            await client.create_sandbox(mounts=mounts)
    assert await client.list_sandboxes() == []
    assert (await client.node_info()).sandbox_count == 0
    # The node still creates sandboxes, with every slot free.
    async with client.create_sandbox(mounts=[(f"{roots}/data", "/data")]) as sandbox:
        assert (await sandbox.exec("true")).ok


async def test_a_daemon_without_roots_refuses_every_mount(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    async with embedded_daemon(backend_classes=fake_backends()) as address, AsyncClient(address) as client:
        with pytest.raises(PermissionDenied, match="allows no bind mounts"):
            await client.create_sandbox(mounts=[(str(tmp_path / "data"), "/data")])
        assert await client.list_sandboxes() == []


async def test_a_tasks_user_is_its_sandboxs_user(client: AsyncClient) -> None:
    """What the rollout service creates for a task (setup, the agent's tools and the evaluation all
    run as the sandbox's default user)."""
    sandbox = await create_task_sandbox(client, rollout_pb2.Task(task_id="t", user="root"), rollout_id="r")
    try:
        assert sandbox.info.user == "root"
        assert (await sandbox.exec(ECHO_USER)).text == "root"
    finally:
        await sandbox.destroy()
    sandbox = await create_task_sandbox(client, rollout_pb2.Task(task_id="t"), rollout_id="r")
    await sandbox.destroy()
    assert sandbox.info.user == ""
