"""The daemon's managers taken on their own, without a gRPC server: the sandbox table's admission
surface (check_open, admit, reserve, add), file calls and a command's working directory
(FileManager), commands and their metrics (ExecManager), and forks (ForkManager), over a
SandboxManager on the fake backend of corral.daemon.testing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral.daemon.backends.base import Backend, BackendStatus, ForkPoint, Limits, SandboxRuntime
from corral.daemon.cgroups import CgroupDriver, LimitSupport
from corral.daemon.config import Config, load_config
from corral.daemon.execs import ExecManager, Exited, Output, Started
from corral.daemon.files import FileManager
from corral.daemon.forks import FORK_GENERATION_LABEL, FORK_PARENT_LABEL, ForkManager
from corral.daemon.metrics import Metrics
from corral.daemon.node import make_backends
from corral.daemon.rules import CommandRequest
from corral.daemon.sandboxes import Sandbox, SandboxManager, new_sandbox_id
from corral.daemon.state import StateStore
from corral.daemon.testing import FakeBackend
from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable


@dataclass
class Managers:
    """A SandboxManager on the fake backend and the managers beside it, as the daemon wires them."""

    config: Config
    state: StateStore
    cgroups: CgroupDriver
    backends: dict[str, Backend]
    metrics: Metrics
    sandboxes: SandboxManager
    files: FileManager
    execs: ExecManager
    forks: ForkManager

    async def create(self, *, network: bool = False, **labels: str) -> Sandbox:
        return await self.sandboxes.create(
            backend="", image="", limits=Limits(), network=network, env={}, labels=labels, idle_timeout_ms=0
        )


@contextlib.asynccontextmanager
async def managers(
    tmp_path: Path, backend: type[Backend] = FakeBackend, *, max_sandboxes: int = 3, **admission: Any
) -> AsyncIterator[Managers]:
    """The managers over a state directory in `tmp_path` (`max_sandboxes` and the [admission]
    keys given), started; closed on exit in the daemon's order."""
    config = load_config(environ={})
    config = dataclasses.replace(
        config,
        daemon=dataclasses.replace(
            config.daemon,
            socket=str(tmp_path / "corral.sock"),
            state_dir=str(tmp_path / "state"),
            max_sandboxes=max_sandboxes,
            memory_overcommit=0,
        ),
        admission=dataclasses.replace(config.admission, **admission),
    )
    state = StateStore(config.state_path)
    cgroups = CgroupDriver(state.daemon_id)
    backends = make_backends(config, cgroups, state.daemon_id, backend_classes={"local": backend})
    metrics = Metrics()
    sandboxes = SandboxManager(config, backends, state, metrics)
    files = FileManager(sandboxes)
    parts = Managers(
        config,
        state,
        cgroups,
        backends,
        metrics,
        sandboxes,
        files,
        ExecManager(config, sandboxes, files, metrics),
        ForkManager(config, sandboxes),
    )
    await sandboxes.start()
    try:
        yield parts
    finally:
        await sandboxes.close()
        files.close()
        for impl in backends.values():
            await impl.close()
        cgroups.remove_base()


def _entry() -> Sandbox:
    """A table entry as create would make it for the fake backend."""
    return Sandbox(new_sandbox_id(), "local", "host", Limits(), False, {}, {}, 0.0)


# -- the sandbox table's admission surface ---------------------------------------------------------


async def test_reserved_sandboxes_count_against_the_node_before_they_are_up(tmp_path) -> None:
    async with managers(tmp_path, max_sandboxes=2) as m:
        m.sandboxes.admit(2, 0, {}, "elsewhere")
        entries = [_entry(), _entry()]
        m.sandboxes.reserve(entries)
        assert len(m.sandboxes) == 2 and entries[0].sandbox_id in m.sandboxes
        with pytest.raises(ResourceExhausted, match=r"already runs 2 sandboxes \(daemon.max_sandboxes\)"):
            m.sandboxes.admit(1, 0, {}, "elsewhere")
        slots = m.metrics.registry.get_sample_value("corral_admission_refusals_total", {"reason": "slots"})
        assert slots == 1
        impl = m.backends["local"]
        with m.sandboxes.gate.starting_slots(2):
            up = await asyncio.gather(*(m.sandboxes.add(entry, impl) for entry in entries))
        assert [sb.state for sb in up] == ["running", "running"] and m.sandboxes.list() == entries
        for entry in entries:
            await m.sandboxes.destroy(entry.sandbox_id)
        assert len(m.sandboxes) == 0 and entries[0].sandbox_id not in m.sandboxes


async def test_a_draining_node_admits_only_its_own_rollouts(tmp_path) -> None:
    async with managers(tmp_path) as m:
        m.sandboxes.own_rollout = lambda labels: labels.get("rollout") == "mine"
        await m.sandboxes.set_draining(True)
        with pytest.raises(Unavailable, match=r"^this node is draining: it takes no new sandboxes \(go elsewhere\)$"):
            m.sandboxes.admit(1, 0, {"rollout": "theirs"}, "go elsewhere")
        m.sandboxes.admit(1, 0, {"rollout": "mine"}, "go elsewhere")
        await m.sandboxes.set_draining(False)
        m.sandboxes.admit(1, 0, {"rollout": "theirs"}, "go elsewhere")


async def test_only_sandboxes_about_to_start_spend_the_rate(tmp_path) -> None:
    async with managers(tmp_path, max_creates_per_s=0.01, create_burst=2) as m:
        for _ in range(3):  # checked, nothing spent
            m.sandboxes.admit(2, 0, {}, "elsewhere")
        m.sandboxes.admit(2, 0, {}, "elsewhere", starting=True)
        with pytest.raises(ResourceExhausted, match="admission.max_creates_per_s"):
            m.sandboxes.admit(1, 0, {}, "elsewhere")
        # The daemon's own rollouts are not paced.
        m.sandboxes.own_rollout = lambda labels: True
        m.sandboxes.admit(1, 0, {}, "elsewhere", starting=True)


async def test_a_closed_table_refuses_creates_forks_and_snapshots(tmp_path) -> None:
    async with managers(tmp_path) as m:
        sandbox = await m.create()
        await m.sandboxes.close()
        assert len(m.sandboxes) == 0
        with pytest.raises(Unavailable, match="the daemon is shutting down"):
            m.sandboxes.check_open()
        with pytest.raises(Unavailable, match="the daemon is shutting down"):
            await m.create()
        with pytest.raises(Unavailable, match="the daemon is shutting down"):
            await m.forks.fork(sandbox.sandbox_id, 1, {})
        with pytest.raises(Unavailable, match="the daemon is shutting down"):
            await m.forks.snapshot(sandbox.sandbox_id, "kept")


class _EnforcingFakeBackend(FakeBackend):
    """The fake backend claiming that it isolates the network and caps the disk."""

    def probe(self) -> BackendStatus:
        status = super().probe()
        enforced = {"network": LimitSupport(True, "test"), "disk": LimitSupport(True, "test")}
        return BackendStatus(status.available, status.detail, status.isolation, {**status.limits, **enforced})


async def test_limits_a_sandbox_was_made_without_are_not_enforced_for_it(tmp_path) -> None:
    async with managers(tmp_path, _EnforcingFakeBackend) as m:
        isolated, networked = await m.create(), await m.create(network=True)
        assert isolated.limits.disk_bytes  # the node's default cap
        assert isolated.limit_support()["network"] == isolated.limit_support()["disk"] == LimitSupport(True, "test")
        assert networked.limit_support()["network"] == LimitSupport(
            False, reason="the sandbox was created with network access"
        )
        m.config.limits.disk_bytes = 0  # a node without a default cap
        uncapped = await m.create()
        assert uncapped.limit_support()["disk"] == LimitSupport(
            False, reason="no cap: limits.disk_bytes is 0 on this node"
        )
        for sandbox in (isolated, networked, uncapped):
            assert sandbox.limit_support()["memory"] == m.backends["local"].status().limits["memory"]


# -- files and a command's working directory -------------------------------------------------------


async def test_a_relative_cwd_is_resolved_against_the_workdir(tmp_path) -> None:
    async with managers(tmp_path) as m:
        sandbox = await m.create()
        assert sandbox.runtime is not None
        workdir = sandbox.runtime.workdir
        assert await m.files.make_dirs(sandbox.sandbox_id, "src/app") == f"{workdir}/src/app"
        assert await m.files.working_directory(sandbox, "src/app") == f"{workdir}/src/app"
        outcome = await m.execs.exec(sandbox.sandbox_id, CommandRequest(argv=["pwd"], shell=None, cwd="src/app"))
        assert outcome.exit.exit_code == 0 and outcome.stdout == f"{workdir}/src/app\n".encode()


async def test_a_cwd_that_is_no_directory_is_refused_before_the_command_starts(tmp_path) -> None:
    async with managers(tmp_path) as m:
        sandbox = await m.create()
        assert sandbox.runtime is not None
        workdir, sid = sandbox.runtime.workdir, sandbox.sandbox_id
        await m.files.write_file(sid, "notes.txt", b"x", 0o644, False)
        with pytest.raises(FailedPrecondition, match=rf"^cwd {workdir}/missing does not exist in sandbox {sid}$"):
            await m.execs.exec(sid, CommandRequest(argv=["pwd"], shell=None, cwd="missing"))
        with pytest.raises(
            FailedPrecondition, match=rf"^cwd {workdir}/notes.txt is not a directory in sandbox {sid} \(it is a file\)$"
        ):
            await m.execs.exec(sid, CommandRequest(argv=["pwd"], shell=None, cwd="notes.txt"))
        assert m.metrics.registry.get_sample_value("corral_execs_total", {"backend": "local"}) is None


async def test_file_calls_pass_through_to_the_sandbox(tmp_path) -> None:
    async with managers(tmp_path) as m:
        sid = (await m.create()).sandbox_id
        assert await m.files.write_file(sid, "a/b.txt", b"hello", 0o600, True) == 5
        assert await m.files.read_file(sid, "a/b.txt", 1, 3) == (b"ell", 5, True)
        assert [(e.name, e.kind, e.size) for e in await m.files.list_dir(sid, "a")] == [("b.txt", "file", 5)]
        absolute, kind = await m.files.path_kind(sid, "a")
        assert kind == "directory" and absolute.endswith("/a")
        await m.files.remove_tree(sid, absolute)  # (an absolute path: the daemon's own calls)
        with pytest.raises(NotFound):
            await m.files.path_kind(sid, "a")
        with pytest.raises(NotFound, match="no sandbox 'sb-nope'"):
            await m.files.read_file("sb-nope", "a", 0, 0)


# -- commands --------------------------------------------------------------------------------------


async def test_commands_are_counted_and_timeouts_too(tmp_path) -> None:
    async with managers(tmp_path) as m:
        sid = (await m.create()).sandbox_id

        def count(name: str) -> float | None:
            return m.metrics.registry.get_sample_value(name, {"backend": "local"})

        assert (await m.execs.exec(sid, CommandRequest(argv=["true"], shell=None))).exit.exit_code == 0
        timed_out = await m.execs.exec(sid, CommandRequest(argv=None, shell="sleep 30", timeout_ms=200))
        assert timed_out.exit.timed_out
        assert (count("corral_execs_total"), count("corral_exec_timeouts_total")) == (2, 1)


async def test_a_streamed_command_starts_outputs_and_exits(tmp_path) -> None:
    async with managers(tmp_path) as m:
        sid = (await m.create()).sandbox_id
        request = CommandRequest(argv=None, shell="printf out; printf err >&2; exit 3", output_limit_bytes=5)
        events = [event async for event in m.execs.exec_stream(sid, request, 0)]
        assert isinstance(events[0], Started) and events[0].pid > 0
        assert isinstance(events[-1], Exited)
        outcome = events[-1].outcome
        assert outcome.exit.exit_code == 3 and outcome.truncated
        assert (outcome.stdout_total, outcome.stderr_total) == (3, 3)
        output = [event for event in events[1:-1] if isinstance(event, Output)]
        assert sum(len(event.data) for event in output) == 5  # the output limit, across both streams


# -- forks and snapshots ---------------------------------------------------------------------------


class _ForkingFakeBackend(FakeBackend):
    """The fake backend with (empty) fork points: its children start as plain fake sandboxes."""

    async def fork_point(self, sandbox: SandboxRuntime) -> ForkPoint:
        return ForkPoint(str(sandbox.record()["sandbox_id"]), "", 0)


async def test_children_carry_their_generation_and_parent(tmp_path) -> None:
    async with managers(tmp_path, _ForkingFakeBackend, max_sandboxes=4) as m:
        parent = await m.create(team="a")
        children = await m.forks.fork(parent.sandbox_id, 2, {"step": "1"})
        assert {child.labels[FORK_PARENT_LABEL] for child in children} == {parent.sandbox_id}
        assert all(child.labels == children[0].labels for child in children)
        assert children[0].labels == {
            "team": "a",
            "step": "1",
            FORK_GENERATION_LABEL: "1",
            FORK_PARENT_LABEL: parent.sandbox_id,
        }
        (grandchild,) = await m.forks.fork(children[0].sandbox_id, 1, {})
        assert grandchild.labels[FORK_GENERATION_LABEL] == "2"
        assert grandchild.labels[FORK_PARENT_LABEL] == children[0].sandbox_id
        assert len(m.sandboxes) == 4 and all(sb.state == "running" for sb in m.sandboxes.list())


async def test_a_fork_past_the_slots_is_refused_and_leaves_nothing(tmp_path) -> None:
    async with managers(tmp_path, _ForkingFakeBackend, max_sandboxes=3) as m:
        parent = await m.create()
        with pytest.raises(ResourceExhausted, match=r"already runs 1 sandboxes, and 3 more would exceed 3"):
            await m.forks.fork(parent.sandbox_id, 3, {})
        assert m.sandboxes.list() == [parent]


async def test_fork_requests_are_checked(tmp_path) -> None:
    async with managers(tmp_path) as m:
        parent = await m.create()
        with pytest.raises(InvalidArgument, match="count must be between 1 and 64, got 0"):
            await m.forks.fork(parent.sandbox_id, 0, {})
        with pytest.raises(InvalidArgument, match="count must be between 1 and 64, got 65"):
            await m.forks.fork(parent.sandbox_id, 65, {})
        with pytest.raises(InvalidArgument, match="either a sandbox id or a snapshot name"):
            await m.forks.fork(parent.sandbox_id, 1, {}, snapshot="kept")
        with pytest.raises(InvalidArgument, match="either a sandbox id or a snapshot name"):
            await m.forks.fork("", 1, {})
        with pytest.raises(NotFound, match="no snapshot named 'kept' on this node"):
            await m.forks.fork("", 1, {}, snapshot="kept")
        with pytest.raises(FailedPrecondition, match="cannot fork sandboxes"):  # the fake backend cannot
            await m.forks.fork(parent.sandbox_id, 1, {})
        assert m.sandboxes.list() == [parent]


async def test_a_snapshot_that_failed_leaves_its_name_free(tmp_path) -> None:
    async with managers(tmp_path) as m:
        sandbox = await m.create()
        with pytest.raises(InvalidArgument, match="a snapshot name is 1 to 128"):
            await m.forks.snapshot(sandbox.sandbox_id, "-bad")
        for _ in range(2):  # not ALREADY_EXISTS the second time
            with pytest.raises(FailedPrecondition, match="cannot snapshot sandboxes"):
                await m.forks.snapshot(sandbox.sandbox_id, "kept")
        assert m.forks.snapshots() == []
        with pytest.raises(NotFound, match="no snapshot named 'kept' on this node"):
            await m.forks.delete_snapshot("kept")
