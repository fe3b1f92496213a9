"""A daemon that stays whole when its node fails it: a create whose state record cannot be saved
(a full disk, no file descriptor left) leaves nothing behind; one sandbox that cannot be described
does not break listing; a state record that cannot be read does not stop the daemon; a stream
abandoned at its first event still has its command killed. On a real daemon in this process, with
the fake backend of corral.daemon.testing (the integration suite repeats the full-disk case on a
real tmpfs)."""

from __future__ import annotations

import asyncio
import errno
import json
from collections import Counter

import grpc
import pytest

from corral.daemon.execs import Started
from corral.daemon.rules import CommandRequest
from corral.daemon.server import Daemon
from corral.daemon.testing import fake_backends, marked_pids
from corral.sdk import AsyncClient, NotFound, ResourceExhausted
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import sandbox_pb2_grpc
from tests.unit import test_fake_daemon
from tests.unit.test_fake_daemon import config_in

MAX_SANDBOXES = 3  # config_in's daemon.max_sandboxes


# The daemon (on its own socket, max_sandboxes 3) and a client of it, as the fake-daemon tests have them.
daemon = test_fake_daemon.daemon
client = test_fake_daemon.client


def _fail_save(daemon: Daemon, which: int, error: int) -> None:
    """Makes the `which`-th record save of every create (0: the placeholder, 1: the full record)
    raise `error`, as a full disk or fd exhaustion would."""
    save = daemon.state.save
    saves: Counter[str] = Counter()

    def failing(sandbox_id: str, record: dict) -> None:
        saves[sandbox_id] += 1
        if saves[sandbox_id] == which + 1:
            raise OSError(error, "injected: " + errno.errorcode[error])
        save(sandbox_id, record)

    daemon.state.save = failing  # type: ignore[method-assign]


@pytest.mark.parametrize("which", [0, 1], ids=["placeholder-record", "full-record"])
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EMFILE], ids=["full-disk", "no-fds"])
async def test_a_create_whose_record_fails_leaves_nothing(daemon, client, tmp_path, which, error) -> None:
    _fail_save(daemon, which, error)
    ids = []
    for _ in range(MAX_SANDBOXES + 1):  # more failures than slots: none may take one
        with pytest.raises(ResourceExhausted, match=r"sandbox (sb-[0-9a-f]{12}) could not be created") as caught:
            await asyncio.wait_for(client.create_sandbox(), 10)
        ids.append(str(caught.value).split()[1])
    assert await client.list_sandboxes() == []
    assert len(daemon.manager) == 0
    for sandbox_id in ids:
        with pytest.raises(NotFound):
            await asyncio.wait_for(client.get_sandbox(sandbox_id), 5)
        with pytest.raises(NotFound):
            await asyncio.wait_for(daemon.manager.destroy(sandbox_id), 5)
        assert marked_pids(sandbox_id) == set()
    workspaces = tmp_path / "state" / "sandboxes"
    assert not (workspaces.is_dir() and list(workspaces.iterdir()))  # the backend's sandboxes are gone
    assert not list(daemon.state.records_dir.iterdir())  # no record, no half-written file
    del daemon.state.save  # the store's own save again
    sandboxes = [await client.create_sandbox() for _ in range(MAX_SANDBOXES)]  # every slot is free
    assert len(await client.list_sandboxes()) == MAX_SANDBOXES
    for sandbox in sandboxes:
        await sandbox.destroy()


async def test_shutdown_is_prompt_after_failed_creates(tmp_path) -> None:
    daemon = Daemon(config_in(tmp_path), backend_classes=fake_backends())
    await daemon.start()
    try:
        _fail_save(daemon, 0, errno.ENOSPC)
        async with AsyncClient(f"unix://{daemon.socket_path}") as client:
            with pytest.raises(ResourceExhausted):
                await client.create_sandbox()
    finally:
        await asyncio.wait_for(daemon.stop(), 10)  # the old phantom made this wait forever


async def test_one_sandbox_that_cannot_be_described_does_not_break_listing(daemon, client) -> None:
    good = await client.create_sandbox(labels={"k": "v"})
    bad = await client.create_sandbox(labels={"k": "v"})
    daemon.manager.get(bad.id).idle_timeout_s = 1e30  # beyond what the reply's uint64 can carry
    listed = {s.id: s for s in await client.list_sandboxes(labels={"k": "v"})}
    assert set(listed) == {good.id, bad.id}
    assert listed[good.id].state == "running" and listed[bad.id].state == "running"
    assert (await client.get_sandbox(bad.id)).id == bad.id
    await good.destroy()
    await bad.destroy()


async def test_a_huge_idle_timeout_is_invalid_and_creates_nothing(daemon) -> None:
    async with grpc.aio.insecure_channel(f"unix://{daemon.socket_path}") as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        for value in (2**64 - 1, 2**63, 2**40):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.CreateSandbox(pb.CreateSandboxRequest(idle_timeout_ms=value))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "idle_timeout_ms must be 1..2592000000 ms" in (caught.value.details() or "")
        assert len(daemon.manager) == 0
        assert list((await stub.ListSandboxes(pb.ListSandboxesRequest())).sandboxes) == []
        created = await stub.CreateSandbox(pb.CreateSandboxRequest(idle_timeout_ms=2592000000))
        assert created.sandbox.idle_timeout_ms == 2592000000
        command = pb.Command(argv=pb.Argv(args=["true"]))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.ExecStream(
                pb.ExecStreamRequest(
                    sandbox_id=created.sandbox.sandbox_id, command=command, keepalive_interval_ms=2**64 - 1
                )
            ):
                pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "keepalive_interval_ms" in (caught.value.details() or "")
        await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=created.sandbox.sandbox_id))


async def test_unreadable_state_records_do_not_stop_the_daemon(tmp_path) -> None:
    records = tmp_path / "state" / "records"
    records.mkdir(parents=True)
    (records / "sb-000000000001.json").write_text("[1, 2]")  # JSON, not an object
    (records / "sb-000000000002.json").write_bytes(b"\xff\xfe{")  # not even text
    (records / "sb-000000000003.json").write_text(json.dumps({"backend": ["local"], "launcher_pid": "x"}))
    (records / "sb-000000000004.json").mkdir()  # not a file
    daemon = Daemon(config_in(tmp_path), backend_classes=fake_backends())
    await daemon.start()
    try:
        assert len(daemon.manager) == 0
        assert sorted(p.name for p in records.iterdir()) == ["sb-000000000004.json"]  # (rmdir is not ours to do)
        async with AsyncClient(f"unix://{daemon.socket_path}") as client:
            sandbox = await client.create_sandbox()
            assert (await sandbox.exec(["true"], timeout=10)).exit_code == 0
            await sandbox.destroy()
    finally:
        await daemon.stop()


async def test_a_stream_abandoned_at_its_first_event_kills_its_command(daemon, client) -> None:
    sandbox = await client.create_sandbox()
    events = daemon.execs.exec_stream(sandbox.id, CommandRequest(argv=None, shell="sleep 1001"), 0)
    assert isinstance(await anext(events), Started)
    await events.aclose()  # the client went away before reading on
    for _ in range(200):
        if not marked_pids(sandbox.id):
            break
        await asyncio.sleep(0.02)
    assert marked_pids(sandbox.id) == set()
    await sandbox.destroy()
