"""A shared daemon keeps its callers apart: what one makes, another cannot see or touch (NOT_FOUND,
worded as for an id that does not exist), while root and admins see everything.

Two users in one process: the daemon here tells callers apart by their bearer token
(corral.daemon.testing.callers_by_token), where the real one reads the socket's peer credentials
(daemon/peer_front.py; tested below through a client in another process, and with real users in
tests/integration/test_shared_daemon.py)."""

from __future__ import annotations

import asyncio
import grp
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from corral.daemon.backends.base import ForkPoint, SandboxRuntime
from corral.daemon.callers import Caller, calling_as, the_daemon, uid_owner
from corral.daemon.config import Config, ConfigError, load_config, validate
from corral.daemon.embedded import embedded_daemon
from corral.daemon.peer_front import PeerCredentials, PeerFront, caller_of
from corral.daemon.server import Daemon, listen_on_socket
from corral.daemon.testing import FakeBackend, callers_by_token, fake_backends
from corral.sdk import AsyncClient
from corral.sdk.errors import NotFound, PermissionDenied, Unavailable, socket_access_hint
from tests.ownership_probes import PROBES, Target, not_found_details, probe_all


class _SnapshottingFakeBackend(FakeBackend):
    """The fake backend with (empty) fork points and named snapshots."""

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        return ForkPoint(str(sandbox.record()["sandbox_id"]), "", 0)

    async def keep_snapshot(self, sandbox: SandboxRuntime, name: str) -> tuple[ForkPoint, int]:
        return await self.fork_point(sandbox), 0

    async def drop_fork_point(self, point: ForkPoint) -> None:
        pass


ALICE, BOB, ROOT = "uid:1001", "uid:1002", "uid:0"


@asynccontextmanager
async def shared_daemon() -> AsyncIterator[str]:
    async with embedded_daemon(
        Config(), backend_classes={"local": _SnapshottingFakeBackend}, caller_of=callers_by_token
    ) as address:
        yield address


@asynccontextmanager
async def as_user(address: str, token: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(address, token=token) as client:
        yield client


async def test_another_callers_sandbox_is_not_found_on_every_rpc_that_names_it() -> None:
    async with shared_daemon() as address, as_user(address, ALICE) as alice, as_user(address, BOB) as bob:
        sandbox = await alice.create_sandbox()
        await sandbox.write_file("secret.txt", b"alice's")
        process = await sandbox.start_process(["sleep", "300"])
        kernel = await sandbox.kernel()
        await sandbox.snapshot("alice-snap")
        target = Target(sandbox.id, kernel.id, process.id, "alice-snap")

        answers = await asyncio.to_thread(_probe_over, address, target, BOB)

        assert set(answers) == set(PROBES)
        assert {name: code for name, (code, _) in answers.items() if code != "NOT_FOUND"} == {}
        for name, (_, details) in answers.items():
            if "Snapshot" not in name and "snapshot" not in name:
                assert details == not_found_details(sandbox.id), name
        assert await bob.list_sandboxes() == [] and await bob.list_snapshots() == []
        # Nothing of Alice's was touched.
        assert await sandbox.read_file("secret.txt") == b"alice's"
        assert not (await sandbox.exec(["ls"])).stdout.count(b"planted")
        assert (await process.poll()).running
        assert [k.id for k in await sandbox.list_kernels()] == [kernel.id]
        assert [s.name for s in await alice.list_snapshots()] == ["alice-snap"]
        assert [s.name for s in await sandbox.list_shells()] == []


async def test_lists_show_the_callers_own_and_root_sees_everyone_s() -> None:
    async with (
        shared_daemon() as address,
        as_user(address, ALICE) as alice,
        as_user(address, BOB) as bob,
        as_user(address, ROOT) as root,
    ):
        mine = await alice.create_sandbox(labels={"team": "x"})
        theirs = await bob.create_sandbox(labels={"team": "x"})
        assert [sb.id for sb in await alice.list_sandboxes()] == [mine.id]
        assert [sb.id for sb in await bob.list_sandboxes({"team": "x"})] == [theirs.id]
        assert {sb.id for sb in await root.list_sandboxes()} == {mine.id, theirs.id}
        # Root acts on anyone's, and what it forks of a user's sandbox is that user's.
        await (await root.get_sandbox(mine.id)).write_file("from-root.txt", b"hi")
        assert await mine.read_file("from-root.txt") == b"hi"
        (child,) = await (await root.get_sandbox(mine.id)).fork(1)
        assert {sb.id for sb in await alice.list_sandboxes()} == {mine.id, child.id}
        await (await root.get_sandbox(theirs.id)).destroy()
        assert await bob.list_sandboxes() == []


async def test_snapshot_names_and_idempotency_keys_are_each_callers_own() -> None:
    async with shared_daemon() as address, as_user(address, ALICE) as alice, as_user(address, BOB) as bob:
        first = await alice.create_sandbox(idempotency_key="k")
        second = await bob.create_sandbox(idempotency_key="k")
        assert first.id != second.id
        await first.snapshot("same")
        await second.snapshot("same")  # no ALREADY_EXISTS: that would say Alice has one
        (alice_child,) = await alice.fork_snapshot("same", 1)
        (bob_child,) = await bob.fork_snapshot("same", 1)
        assert alice_child.info.labels.get("corral.fork.parent") == first.id
        assert bob_child.info.labels.get("corral.fork.parent") == second.id
        with pytest.raises(NotFound):
            await bob.get_sandbox(alice_child.id)
        await bob.delete_snapshot("same")
        assert [s.sandbox_id for s in await alice.list_snapshots()] == [first.id]


@pytest.mark.parametrize("admin_group", ["", grp.getgrgid(0).gr_name])
async def test_only_the_nodes_operator_changes_the_node(admin_group: str) -> None:
    """Drain, the LLM servers and the policy version are every user's: a caller who is neither
    root nor in daemon.admin_group is refused, told which group to join; reads stay open."""
    config = Config()
    config.daemon.admin_group = admin_group
    changes = {
        "Drain": lambda c: c.drain(True),
        "RegisterLLM": lambda c: c.rollouts.register_llm("http://127.0.0.1:9"),
        "RemoveLLM": lambda c: c.rollouts.remove_llm("http://127.0.0.1:9"),
        "SetPolicyVersion": lambda c: c.rollouts.set_policy_version(3),
    }
    async with (
        embedded_daemon(config, backend_classes=fake_backends(), caller_of=callers_by_token) as address,
        as_user(address, ALICE) as alice,
        as_user(address, ROOT) as root,
    ):
        for method, change in changes.items():
            with pytest.raises(PermissionDenied) as refused:
                await change(alice)
            said = str(refused.value)
            assert method in said and "daemon.admin_group" in said, said
            assert (f"group {admin_group!r}" in said) == bool(admin_group), said
        assert await alice.rollouts.list_llms() == [] and not (await alice.node_info()).draining
        await alice.rollouts.stats()
        # Root (an admin) may, and what it did is what everyone sees.
        await root.rollouts.register_llm("http://127.0.0.1:9")
        assert await root.rollouts.set_policy_version(3) == 3
        await root.rollouts.remove_llm("http://127.0.0.1:9")
        await root.drain(True)
        assert (await alice.node_info()).draining
        await root.drain(False)


async def test_the_daemons_own_creates_for_a_rollout_are_its_submitters(tmp_path) -> None:
    daemon = Daemon(_config_in(tmp_path), backend_classes=fake_backends())
    await daemon.start()
    try:
        daemon.manager.rollout_owner = lambda labels: ALICE if labels.get("io.corral.rollout") == "r1" else None
        with calling_as(the_daemon()):
            for_rollout = await _create(daemon, {"io.corral.rollout": "r1"})
            its_own = await _create(daemon, {})
        with calling_as(Caller(BOB)):  # a caller's label names no rollout of its own
            forged = await _create(daemon, {"io.corral.rollout": "r1"})
        assert (for_rollout.owner, its_own.owner, forged.owner) == (ALICE, uid_owner(os.geteuid()), BOB)
        with calling_as(Caller(BOB)), pytest.raises(NotFound):
            daemon.manager.get(for_rollout.sandbox_id)
    finally:
        await daemon.stop()


async def test_callers_on_the_socket_are_told_apart_by_their_peer_credentials(tmp_path) -> None:
    """A shared socket (a socket_group: here the test's own group): a client in another process
    is its uid; one in the daemon's own process is the daemon (its rollout service)."""
    config = _config_in(tmp_path)
    config.daemon.socket_group = grp.getgrgid(os.getgid()).gr_name
    daemon = Daemon(config, backend_classes=fake_backends())
    await daemon.start()
    try:
        assert daemon.front is not None
        address = f"unix://{daemon.socket_path}"
        script = "import sys; from corral.sdk import Client; print(Client(sys.argv[1]).create_sandbox().id)"
        made = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", script, address], capture_output=True, text=True, check=True
        )
        (other,) = daemon.manager.list()
        assert other.sandbox_id == made.stdout.strip() and other.owner == uid_owner(os.geteuid())
        async with AsyncClient(address) as client:
            assert {sb.id for sb in await client.list_sandboxes()} == {other.sandbox_id}  # the daemon sees all
    finally:
        await daemon.stop()


async def test_a_socket_only_the_daemons_user_may_open_needs_no_front(tmp_path) -> None:
    """The default socket (the daemon's user and group, no one else): one caller, the daemon's
    user, an admin; calls go straight to gRPC, with no relay in between."""
    daemon = Daemon(_config_in(tmp_path), backend_classes=fake_backends())
    await daemon.start()
    try:
        assert daemon.front is None
        script = "import sys; from corral.sdk import Client; print(Client(sys.argv[1]).create_sandbox().id)"
        address = f"unix://{daemon.socket_path}"
        made = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", script, address], capture_output=True, text=True, check=True
        )
        (sandbox,) = daemon.manager.list()
        assert sandbox.sandbox_id == made.stdout.strip() and sandbox.owner == the_daemon().owner
    finally:
        await daemon.stop()


def test_who_peer_credentials_make() -> None:
    stranger = os.getpid() + 1
    assert caller_of(PeerCredentials(stranger, 1001, 1001, frozenset()), None) == Caller(ALICE)
    assert caller_of(PeerCredentials(stranger, 0, 0, frozenset()), None) == Caller(ROOT, admin=True)
    assert caller_of(PeerCredentials(stranger, 1001, 1001, frozenset({50})), 50).admin
    assert caller_of(PeerCredentials(stranger, 1001, 50, frozenset()), 50).admin
    assert caller_of(PeerCredentials(os.getpid(), 1001, 1001, frozenset()), None).internal
    # Only admins (and the daemon) may change the node, of the socket's callers.
    assert not caller_of(PeerCredentials(stranger, 1001, 1001, frozenset()), 50).may_change_node()
    assert caller_of(PeerCredentials(stranger, 1001, 1001, frozenset({50})), 50).may_change_node()


def test_a_peer_that_is_no_connection_of_the_front_has_no_credentials(tmp_path) -> None:
    front = PeerFront(tmp_path / "front")
    assert front.credentials("unix:") is None
    assert front.credentials("unix-abstract:corral-peer-unknown") is None
    assert front.credentials("ipv4:127.0.0.1:5000") is None
    assert stat.S_IMODE(os.stat(tmp_path / "front").st_mode) == 0o700


def test_the_socket_is_made_with_its_mode_and_group(tmp_path) -> None:
    group = os.getgroups()[-1] if os.getgroups() else os.getgid()
    sock = listen_on_socket(tmp_path / "c.sock", 0o660, group)
    try:
        info = os.stat(tmp_path / "c.sock")
        assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == group
    finally:
        sock.close()


@pytest.mark.parametrize("key", ["socket_group", "admin_group"])
def test_a_group_the_host_lacks_is_a_config_error(key) -> None:
    config = load_config(environ={})
    setattr(config.daemon, key, "corral-no-such-group")
    with pytest.raises(ConfigError, match=rf"daemon\.{key}: no group 'corral-no-such-group'"):
        validate(config)


def test_a_refused_socket_names_its_group_not_start_one(tmp_path) -> None:
    path = tmp_path / "c.sock"
    sock = listen_on_socket(path, 0o660, os.getgid())
    try:
        group = grp.getgrgid(os.getgid()).gr_name
        hint = socket_access_hint(f"unix://{path}")
        assert hint is not None and "start" not in hint
        assert (f"group {group!r}" in hint) if os.getgid() else ("daemon.socket_group" in hint)
        assert socket_access_hint("tcp://127.0.0.1:1") is None
    finally:
        sock.close()


def test_an_unavailable_socket_carries_the_hint(tmp_path) -> None:
    from corral.sdk.errors import error_from_rpc

    path = tmp_path / "c.sock"
    sock = listen_on_socket(path, 0o660, os.getgid())
    try:
        err = error_from_rpc(_Refused(f"unix:{path}: Permission denied"), address=f"unix://{path}")
        assert isinstance(err, Unavailable) and err.hint and err.hint in str(err)
    finally:
        sock.close()


class _Refused(grpc.RpcError):
    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def _probe_over(address: str, target: Target, token: str) -> dict[str, tuple[str, str]]:
    with grpc.insecure_channel(address) as channel:
        return probe_all(channel, target, token)


async def _create(daemon: Daemon, labels: dict[str, str]):
    from corral.daemon.backends.base import Limits

    return await daemon.manager.create(
        backend="", image="", limits=Limits(), network=False, env={}, labels=labels, idle_timeout_ms=0
    )


def _config_in(tmp_path: Path) -> Config:
    config = load_config(environ={})
    config.daemon.socket = str(tmp_path / "corral.sock")
    config.daemon.state_dir = str(tmp_path / "state")
    return config


def test_what_a_caller_sends_before_its_relay_stands_reaches_the_server_first(tmp_path) -> None:
    """(Some Pythons read a connection at once though connection_made paused it.)"""
    from corral.daemon.peer_front import _ClientSide, _Relay

    class _Transport:
        def __init__(self) -> None:
            self.written: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.written.append(data)

        def resume_reading(self) -> None:
            pass

    client, server = _ClientSide(PeerFront(tmp_path / "front")), _Relay()
    client.transport, server.transport = _Transport(), _Transport()  # type: ignore[assignment]
    client.data_received(b"PRI * HTTP/2.0")
    client.started(server)
    client.data_received(b"SETTINGS")
    assert server.transport.written == [b"PRI * HTTP/2.0", b"SETTINGS"]  # type: ignore[union-attr]
