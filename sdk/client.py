"""The asyncio client: `AsyncClient`, `AsyncSandbox`, `AsyncExecStream`, `AsyncShell`, `AsyncKernel`
and `AsyncKernelExecuteStream`. One AsyncClient serves any number of event loops, one after another
(asyncio.run() per operation) or at once (a loop per thread): each loop gets its own channel.

The blocking client (`sync_client.py`) is generated from this file by scripts/unasync.py: edit this
one, then run `make sync-client` (CI fails when the two drift). Requests, deadlines and decoding
live in `_core`; what differs between asyncio and threads lives in the transports; this module
only makes the calls.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Self

from corral.sdk import _core
from corral.sdk._address import resolve_address, resolve_token
from corral.sdk._archive import archive_name, download_spool, extract_archive, tar_chunks
from corral.sdk._async_transport import AsyncResponseStream, AsyncTransport, AwaitableContext
from corral.sdk._core import DEFAULT_CALL_TIMEOUT_S, Command, EventT, MountSpec
from corral.sdk._process_core import ProcessInfo, build_start_process_request, process_info_from_proto
from corral.sdk.errors import AlreadyExists, CorralError, NotFound
from corral.sdk.processes import AsyncProcess, AsyncTerminal
from corral.sdk.rollouts import AsyncRollouts
from corral.sdk.types import (
    DrainState,
    ExecEvent,
    ExecResult,
    FileEntry,
    KernelEvent,
    KernelInfo,
    KernelResult,
    NodeInfo,
    SandboxInfo,
    ShellInfo,
    ShellResult,
    SnapshotInfo,
)
from corral.v1 import kernel_pb2 as kernel_pb
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import shell_pb2 as shell_pb

_log = logging.getLogger(__name__)


class AsyncClient:
    """A connection to one corral daemon.

    `address`: "unix:///path", "/path", "host:port" or "tcp://host:port"; default: $CORRAL_ADDRESS,
    else $CORRAL_SOCKET, else unix:///run/corral/corral.sock. `token`: bearer token for a TCP
    listener; default $CORRAL_TOKEN. `timeout`: deadline in seconds of each call other than exec
    (exec calls get the command's timeout plus a margin).
    """

    def __init__(
        self, address: str | None = None, token: str | None = None, timeout: float = DEFAULT_CALL_TIMEOUT_S
    ) -> None:
        self._transport = AsyncTransport(resolve_address(address), resolve_token(token), timeout)

    @property
    def address(self) -> str:
        """The daemon address this client talks to, e.g. "unix:///run/corral/corral.sock"."""
        return str(self._transport.address)

    @property
    def rollouts(self) -> AsyncRollouts:
        """The daemon's RolloutService: LLM servers, and rollouts of tasks."""
        return AsyncRollouts(self._transport)

    def create_sandbox(
        self,
        image: str | None = None,
        backend: str | None = None,
        *,
        memory_bytes: int | None = None,
        pids: int | None = None,
        cpu_millicores: int | None = None,
        disk_bytes: int | None = None,
        network: bool = False,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        idle_timeout: float | None = None,
        user: str | None = None,
        mounts: Sequence[MountSpec] | None = None,
        lease_ttl_s: float | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> AwaitableContext[AsyncSandbox]:
        """Creates a sandbox and waits until it can run commands, and returns its handle. Used as
        `async with client.create_sandbox(...) as sandbox:`, it also destroys it after the block.

        `image`: "host", a root filesystem directory or a container image such as
        "docker-archive:/path/image.tar" or "docker:NAME" (local), an image name (docker), or None
        for the daemon's default image of the backend. `backend`: "local", "docker",
        "singularity", or None for the daemon's default. Limits left
        None take the daemon's defaults; `disk_bytes` caps its writable space (ENOSPC inside past it). `idle_timeout`: seconds without calls before the daemon
        destroys it (None: the daemon's default). `user`: who its commands, shells and kernels run
        as unless a call names another: a user name of the image, a uid or "uid:gid" (None: the
        image's own user). `mounts`: host paths shown inside, each a `Mount` or a tuple
        (host_path, sandbox_path[, writable]), read-only unless writable; the daemon allows only
        host paths under its sandbox.bind_roots (PermissionDenied otherwise). `lease_ttl_s`: a
        lease; the daemon destroys the sandbox this long after it is up unless `renew_lease` (or
        `keep_alive`) extends it, so a crashed client leaks nothing (None: no lease).
        `idempotency_key`: makes retrying this call safe; a create with a key the daemon knows
        returns that key's sandbox (the same key with another request: FailedPrecondition).
        `timeout`: deadline of this call (pulling an image can take longer than the client
        default). Past the node's admission caps: ResourceExhausted with `retry_after_s`; on a
        draining node: Unavailable.
        """
        request = _core.build_create_sandbox_request(
            image=image,
            backend=backend,
            memory_bytes=memory_bytes,
            pids=pids,
            cpu_millicores=cpu_millicores,
            disk_bytes=disk_bytes,
            network=network,
            env=env,
            labels=labels,
            idle_timeout=idle_timeout,
            user=user,
            mounts=mounts,
            lease_ttl=lease_ttl_s,
            idempotency_key=idempotency_key,
        )
        return AwaitableContext(self._create_sandbox(request, timeout))

    async def _create_sandbox(self, request: pb.CreateSandboxRequest, timeout: float | None) -> AsyncSandbox:
        response = await self._transport.unary(self._transport.sandbox_service.CreateSandbox, request, timeout=timeout)
        return AsyncSandbox(self._transport, _core.sandbox_info_from_proto(response.sandbox))

    async def get_sandbox(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox; raises SandboxNotFound for an unknown id."""
        response = await self._transport.unary(
            self._transport.sandbox_service.GetSandbox, _core.build_get_sandbox_request(sandbox_id)
        )
        return AsyncSandbox(self._transport, _core.sandbox_info_from_proto(response.sandbox))

    async def list_sandboxes(self, labels: Mapping[str, str] | None = None) -> list[SandboxInfo]:
        """The daemon's sandboxes, only those carrying all of `labels` if given. `get_sandbox(id)`
        gives a handle on one."""
        response = await self._transport.unary(
            self._transport.sandbox_service.ListSandboxes, _core.build_list_sandboxes_request(labels)
        )
        return [_core.sandbox_info_from_proto(sandbox) for sandbox in response.sandboxes]

    async def fork_snapshot(
        self,
        name: str,
        count: int = 1,
        *,
        labels: Mapping[str, str] | None = None,
        lease_ttl_s: float | None = None,
        timeout: float | None = None,
    ) -> list[AsyncSandbox]:
        """`count` (1..64) new sandboxes made from the named snapshot `name` (Sandbox.snapshot):
        its files, and the image, limits, env, user and labels its sandbox had (plus `labels`).
        NotFound for an unknown name. `lease_ttl_s` and admission: as Sandbox.fork."""
        response = await self._transport.unary(
            self._transport.sandbox_service.ForkSandbox,
            _core.build_fork_sandbox_request("", count, labels, snapshot=name, lease_ttl=lease_ttl_s),
            timeout=timeout,
        )
        return [AsyncSandbox(self._transport, _core.sandbox_info_from_proto(sb)) for sb in response.sandboxes]

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """The node's named snapshots."""
        response = await self._transport.unary(self._transport.sandbox_service.ListSnapshots, pb.ListSnapshotsRequest())
        return [_core.snapshot_info_from_proto(s) for s in response.snapshots]

    async def delete_snapshot(self, name: str) -> None:
        """Deletes a named snapshot (sandboxes made from it keep their files); NotFound if unknown."""
        await self._transport.unary(self._transport.sandbox_service.DeleteSnapshot, pb.DeleteSnapshotRequest(name=name))

    async def node_info(self) -> NodeInfo:
        """What this node can do: backends, isolation, enforced limits, cgroup mode."""
        response = await self._transport.unary(
            self._transport.sandbox_service.GetNodeInfo, _core.build_node_info_request()
        )
        return _core.node_info_from_proto(response)

    async def drain(self, drain: bool = True) -> DrainState:
        """Drains the node (no new sandboxes or rollouts; what runs finishes), or with
        drain=False takes it back into service. Returns whether it drains and is empty."""
        response = await self._transport.unary(self._transport.sandbox_service.Drain, _core.build_drain_request(drain))
        return _core.drain_state_from_proto(response)

    async def close(self) -> None:
        """Closes the connection; sandboxes stay alive on the daemon."""
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient(address={self.address!r})"


class AsyncSandbox:
    """A handle on one sandbox. As an async context manager it destroys the sandbox on exit:
    `async with client.create_sandbox() as sandbox: ...`.

    Obtained from `AsyncClient.create_sandbox` or `get_sandbox`; it uses its client's connection,
    so it stops working once the client is closed.
    """

    def __init__(self, transport: AsyncTransport, info: SandboxInfo) -> None:
        self._transport = transport
        self._info = info
        self._destroyed = False

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        """What the daemon last said about this sandbox; `refresh()` asks again."""
        return self._info

    async def exec(
        self,
        cmd: Command,
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
        user: str | None = None,
        check: bool = False,
    ) -> ExecResult:
        """Runs a command to completion and returns its exit status and output.

        `cmd`: a list of str runs as argv; a str runs under the sandbox's shell. `stdin`: bytes
        fed to the command (None: stdin at EOF). `cwd`: where it starts, relative to the workdir
        unless absolute (None: the workdir). `timeout`: seconds, after which the whole process
        tree is killed and `timed_out` is set (None: the daemon's default, exec.default_timeout_s,
        600 s unless configured; the call then waits for the daemon's answer). `output_limit`:
        bytes kept per stream (None: the daemon's default, 1 MiB). `user`: who it runs as, a user
        name, a uid or "uid:gid" (None: the sandbox's default user). `check`: raise
        CommandExitError unless the result is `ok`.
        """
        request = _core.build_exec_request(
            self.id, cmd, stdin=stdin, env=env, cwd=cwd, timeout=timeout, output_limit=output_limit, user=user
        )
        response = await self._transport.unary(
            self._transport.sandbox_service.Exec, request, timeout=_core.exec_deadline(timeout)
        )
        result = _core.exec_result_from_proto(response)
        return result.check() if check else result

    def exec_stream(
        self,
        cmd: Command,
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
        keepalive: float | None = None,
        user: str | None = None,
    ) -> AsyncExecStream:
        """Runs a command and streams its events as they happen: ExecStarted, then ExecOutput and
        ExecKeepalive (every `keepalive` seconds without output), then ExecExited. `cwd`,
        `timeout`, `output_limit` and `user` as for `exec`.

        Closing the stream before ExecExited (or leaving its `async with` block) kills the command.
        Use: `async with sandbox.exec_stream([...]) as events: async for e in events: ...`.
        """
        request = _core.build_exec_stream_request(
            self.id,
            cmd,
            stdin=stdin,
            env=env,
            cwd=cwd,
            timeout=timeout,
            output_limit=output_limit,
            keepalive=keepalive,
            user=user,
        )
        return AsyncExecStream(
            self._transport.server_stream(
                self._transport.sandbox_service.ExecStream, request, timeout=_core.exec_deadline(timeout)
            )
        )

    async def read_file(self, path: str, offset: int = 0, limit: int | None = None) -> bytes:
        """Reads `limit` bytes (None: all) of a file from `offset`; relative paths are relative to
        the workdir. At most 64 MiB (`READ_FILE_MAX_BYTES`, and the daemon's own cap): a bigger read
        raises FailedPrecondition naming the size; `download` streams any size to disk."""
        plan = _core.read_file_plan(self.id, path, offset=offset, limit=limit)
        return await self._transport.run_plan(self._transport.sandbox_service.ReadFile, plan)

    async def write_file(
        self, path: str, data: bytes | str, mode: int | None = None, make_parents: bool = True
    ) -> None:
        """Writes a whole file, replacing it if it exists. A str is written as UTF-8. `mode`:
        permission bits of a new file (None: 0o644)."""
        request = _core.build_write_file_request(self.id, path, data, mode=mode, make_parents=make_parents)
        await self._transport.unary(self._transport.sandbox_service.WriteFile, request)

    async def list_dir(self, path: str) -> list[FileEntry]:
        """The entries of a directory, sorted by name."""
        response = await self._transport.unary(
            self._transport.sandbox_service.ListDir, _core.build_list_dir_request(self.id, path)
        )
        return [_core.file_entry_from_proto(entry) for entry in response.entries]

    async def upload(self, local_path: str | os.PathLike[str], remote_dir: str, *, timeout: float | None = None) -> str:
        """Copies a local file or directory into `remote_dir` (created if missing) and returns its
        path inside the sandbox. `timeout`: deadline of the transfer (None: the client default)."""
        requests = _core.upload_requests(self.id, remote_dir, tar_chunks(local_path))
        await self._transport.client_stream(self._transport.sandbox_service.Upload, requests, timeout=timeout)
        return posixpath.join(remote_dir, archive_name(local_path))

    async def download(
        self, remote_path: str, local_dir: str | os.PathLike[str], *, timeout: float | None = None
    ) -> Path:
        """Copies a file or directory out of the sandbox into `local_dir` (created if missing) and
        returns its local path. Nothing is unpacked unless the whole archive arrived."""
        request = _core.build_download_request(self.id, remote_path)
        with download_spool() as archive:
            async with self._transport.server_stream(
                self._transport.sandbox_service.Download, request, timeout=timeout
            ) as responses:
                async for response in responses:
                    archive.write(response.chunk)
            return await self._transport.offload(extract_archive, archive, local_dir)

    async def shell(
        self,
        name: str = _core.DEFAULT_SHELL_NAME,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        rows: int | None = None,
        cols: int | None = None,
        program: str | None = None,
        user: str | None = None,
        open: bool = True,
    ) -> AsyncShell:
        """A persistent shell session called `name`: cwd, variables and functions carry over from
        one `AsyncShell.run` to the next.

        With `open` (the default) the session is started, or, when the sandbox already has one of
        that name, attached to (so `shell("main")` twice gives the same session; `env`, `cwd`,
        `rows`, `cols` and `program` then keep the values it was opened with). `open=False` only
        makes a handle, for a session opened elsewhere. `env`: extra variables; `cwd`: starting
        directory (None: the workdir); `rows`/`cols`: terminal size (None: 40x200); `program`:
        the shell inside the sandbox (None: bash, else sh); `user`: who the shell runs as, a user
        name, a uid or "uid:gid" (None: the sandbox's default user).
        """
        shell = AsyncShell(self._transport, self.id, name)
        if open:
            await shell._open(
                _core.build_open_shell_request(
                    self.id, name, env=env, cwd=cwd, rows=rows, cols=cols, program=program, user=user
                )
            )
        return shell

    async def list_shells(self) -> list[ShellInfo]:
        """The sandbox's shell sessions; `shell(name, open=False)` gives a handle on one."""
        response = await self._transport.unary(
            self._transport.shell_service.ListShells, _core.build_list_shells_request(self.id)
        )
        return [_core.shell_info_from_proto(shell) for shell in response.shells]

    async def start_process(
        self,
        cmd: Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        rows: int | None = None,
        cols: int | None = None,
        term: str | None = None,
        interactive: bool = False,
        buffer_size: int | None = None,
    ) -> AsyncProcess:
        """Starts a command under a pty of its own and returns at once, with a handle to read its
        output, type input, signal it and wait for it (`AsyncProcess`). It runs until it exits,
        `close()`, or the sandbox's end; what it leaves running is killed when it exits.

        `cmd`: a list of str runs as argv; a str runs under the sandbox's shell. `cwd`: absolute
        (None: the workdir). `rows`, `cols`: terminal size (None: 24x80); `term`: $TERM (None:
        "dumb"). `interactive`: an ordinary terminal that echoes input and shows \\n as \\r\\n
        (False: output as written, no echo). `buffer_size`: bytes of output the daemon keeps
        (None: 1 MiB; older output is dropped and counted in `dropped_bytes`)."""
        info = await self._start_process(
            cmd,
            env=env,
            cwd=cwd,
            user=user,
            rows=rows,
            cols=cols,
            term=term,
            interactive=interactive,
            buffer_size=buffer_size,
        )
        return AsyncProcess(self._transport, info)

    async def terminal(
        self,
        program: str | Sequence[str] = "bash",
        *,
        rows: int = 24,
        cols: int = 80,
        term: str = "dumb",
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> AsyncTerminal:
        """An interactive program (argv, or a program name; default: bash) on an ordinary
        terminal, driven by keys (`AsyncTerminal.send_keys`) and read as text (`screen()`,
        `expect`). Close it (or leave its `async with` block) to kill it."""
        argv = [program] if isinstance(program, str) else list(program)
        info = await self._start_process(
            argv, env=env, cwd=cwd, user=user, rows=rows, cols=cols, term=term, interactive=True, buffer_size=None
        )
        return AsyncTerminal(self._transport, info, rows)

    async def _start_process(self, cmd: Command, **options: Any) -> ProcessInfo:
        request = build_start_process_request(self.id, cmd, **options)
        response = await self._transport.unary(self._transport.shell_service.StartProcess, request)
        return process_info_from_proto(response.process)

    async def list_processes(self) -> list[ProcessInfo]:
        """The sandbox's background processes, running and finished (until closed), oldest first."""
        response = await self._transport.unary(
            self._transport.shell_service.ListProcesses, shell_pb.ListProcessesRequest(sandbox_id=self.id)
        )
        return [process_info_from_proto(info) for info in response.processes]

    async def kernel(
        self,
        *,
        python: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        auto_restart: bool = True,
    ) -> AsyncKernel:
        """Starts an IPython kernel; its state persists across `AsyncKernel.execute` calls.

        `python`: the interpreter inside the sandbox (None: python3), which must have ipykernel
        (FailedPrecondition says what is missing otherwise). `cwd`: its working directory (None:
        the workdir). `env`: extra variables. `user`: who it runs as, a user name, a uid or
        "uid:gid" (None: the sandbox's default user). `auto_restart`: a cell sent after the
        kernel died restarts it first (`KernelResult.restarted`), within the daemon's limit
        (kernel.max_auto_restarts); False: such cells raise FailedPrecondition until `restart()`.
        """
        request = _core.build_start_kernel_request(
            self.id, python=python, cwd=cwd, env=env, user=user, auto_restart=auto_restart
        )
        response = await self._transport.unary(
            self._transport.kernel_service.StartKernel, request, timeout=_kernel_start_deadline(self._transport)
        )
        return AsyncKernel(self._transport, _core.kernel_info_from_proto(response.kernel))

    async def get_kernel(self, kernel_id: str) -> AsyncKernel:
        """A handle on a running kernel of this sandbox; raises NotFound for an unknown id."""
        return AsyncKernel(self._transport, await _lookup_kernel(self._transport, self.id, kernel_id))

    async def list_kernels(self) -> list[KernelInfo]:
        """The sandbox's kernels; `get_kernel(id)` gives a handle on one."""
        response = await self._transport.unary(
            self._transport.kernel_service.ListKernels, _core.build_list_kernels_request(self.id)
        )
        return [_core.kernel_info_from_proto(kernel) for kernel in response.kernels]

    async def refresh(self) -> SandboxInfo:
        """Asks the daemon for this sandbox's current state and returns it (also in `.info`)."""
        response = await self._transport.unary(
            self._transport.sandbox_service.GetSandbox, _core.build_get_sandbox_request(self.id)
        )
        self._info = _core.sandbox_info_from_proto(response.sandbox)
        return self._info

    async def renew_lease(self, ttl_s: float) -> SandboxInfo:
        """Sets the sandbox's lease to expire `ttl_s` seconds from now (a sandbox without a lease
        gets one); returns its info, also in `.info`."""
        response = await self._transport.unary(
            self._transport.sandbox_service.RenewLease, _core.build_renew_lease_request(self.id, ttl_s)
        )
        self._info = _core.sandbox_info_from_proto(response.sandbox)
        return self._info

    def keep_alive(self, ttl_s: float = 30.0, *, interval_s: float | None = None) -> _LeaseKeeper:
        """A context manager that keeps the sandbox's lease alive while its block runs: it sets a
        lease of `ttl_s` at entry, renews it every `interval_s` (a third of the TTL by default)
        in the background, and stops at exit. A renewal that fails is logged and tried again at
        the next interval; if this process dies, the lease runs out and the daemon destroys the
        sandbox."""
        return _LeaseKeeper(self, self._transport, ttl_s, interval_s or ttl_s / 3)

    async def fork(
        self,
        count: int,
        *,
        labels: Mapping[str, str] | None = None,
        lease_ttl_s: float | None = None,
        timeout: float | None = None,
    ) -> list[AsyncSandbox]:
        """`count` (1..64) new sandboxes whose files start as a copy-on-write copy of this one's
        now: its image, limits, env, user and labels (plus `labels`, "corral.fork.generation" and
        "corral.fork.parent"). Running processes are not copied; this sandbox keeps running. All
        or none: a failed fork raises and leaves no child. Local and docker backends with
        storage = "btrfs", and singularity and a local daemon without root (a copy, reflinked
        where the filesystem can); FailedPrecondition elsewhere. `lease_ttl_s`: a lease for
        each child, as create_sandbox's (None: none; this sandbox's lease is not inherited). The
        node admits a fork as `count` creates: ResourceExhausted (with `retry_after_s` for its
        caps) past them; Unavailable while it drains."""
        response = await self._transport.unary(
            self._transport.sandbox_service.ForkSandbox,
            _core.build_fork_sandbox_request(self.id, count, labels, lease_ttl=lease_ttl_s),
            timeout=timeout,
        )
        return [AsyncSandbox(self._transport, _core.sandbox_info_from_proto(sb)) for sb in response.sandboxes]

    async def snapshot(self, name: str, *, timeout: float | None = None) -> SnapshotInfo:
        """Keeps a copy of this sandbox's files under `name`, from which Client.fork_snapshot
        makes sandboxes later, after this one is gone too (until delete_snapshot or the daemon's
        restart). AlreadyExists for a taken name; ResourceExhausted past the node's store."""
        response = await self._transport.unary(
            self._transport.sandbox_service.SnapshotSandbox,
            pb.SnapshotSandboxRequest(sandbox_id=self.id, name=name),
            timeout=timeout,
        )
        return _core.snapshot_info_from_proto(response.snapshot)

    async def destroy(self) -> None:
        """Kills everything in the sandbox and removes it. Destroying a sandbox that is already
        gone is not an error."""
        if self._destroyed:
            return
        try:
            await self._transport.unary(
                self._transport.sandbox_service.DestroySandbox, _core.build_destroy_sandbox_request(self.id)
            )
        except NotFound:
            pass  # destroyed elsewhere or reaped by its idle timeout: the goal is reached
        self._destroyed = True

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc is None:
            await self.destroy()
            return
        try:
            await self.destroy()
        except CorralError as error:
            # The body's exception is the one the caller needs to see; the daemon's idle timeout
            # reaps a sandbox that could not be destroyed now.
            _log.warning("could not destroy sandbox %s: %s", self.id, error)

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, backend={self._info.backend!r}, image={self._info.image!r})"


class _LeaseKeeper:
    """AsyncSandbox.keep_alive's context manager."""

    def __init__(self, sandbox: AsyncSandbox, transport: AsyncTransport, ttl_s: float, interval_s: float) -> None:
        self._sandbox = sandbox
        self._transport = transport
        self._ttl_s = ttl_s
        self._interval_s = interval_s
        self._renewer: Any = None

    async def _renew(self) -> None:
        try:
            await self._sandbox.renew_lease(self._ttl_s)
        except CorralError as error:
            _log.warning("could not renew the lease of sandbox %s: %s", self._sandbox.id, error)

    async def __aenter__(self) -> AsyncSandbox:
        await self._sandbox.renew_lease(self._ttl_s)
        self._renewer = self._transport.periodic(self._renew, self._interval_s)
        return self._sandbox

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._renewer.cancel()


class _AsyncEventStream(Generic[EventT]):
    """Typed events decoded from one server stream; iterate it, ideally in its `async with`
    block. Closing it before the final event cancels the call."""

    def __init__(self, responses: AsyncResponseStream, decoder: _core.StreamDecoder) -> None:
        self._responses = responses
        self._decoder = decoder

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EventT:
        try:
            response = await self._responses.__anext__()
        except StopAsyncIteration:
            if not self._responses.closed:
                self._decoder.finish()  # a stream that ended by itself must have said how
            raise
        return self._decoder.decode(response)

    async def close(self) -> None:
        await self._responses.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()


class AsyncExecStream(_AsyncEventStream[ExecEvent]):
    """The events of one streamed command (see `AsyncSandbox.exec_stream`). Closing it before
    ExecExited cancels the call, which kills the command."""

    def __init__(self, responses: AsyncResponseStream[pb.ExecStreamResponse]) -> None:
        super().__init__(responses, _core.ExecEventDecoder())


class AsyncShell:
    """A persistent shell session in a sandbox (see `AsyncSandbox.shell`). As an async context
    manager it closes the session on exit: `async with await sandbox.shell() as shell: ...`.

    Commands in one session run one at a time, in order; several sessions of a sandbox are
    independent.
    """

    def __init__(self, transport: AsyncTransport, sandbox_id: str, name: str) -> None:
        self._transport = transport
        self._sandbox_id = sandbox_id
        self._name = name
        self._info: ShellInfo | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def sandbox_id(self) -> str:
        return self._sandbox_id

    @property
    def info(self) -> ShellInfo | None:
        """What the daemon last said about this session (None for a handle made with
        `open=False` until `refresh()`)."""
        return self._info

    async def run(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        output_limit: int | None = None,
        strip_ansi: bool = False,
        separate_stderr: bool = False,
        check: bool = False,
    ) -> ShellResult:
        """Runs one command (any bash text: several lines, heredocs, ...) in the session and
        returns its exit code and output.

        `timeout`: seconds, after which the command is interrupted (SIGINT, stdin EOF, then
        SIGKILL) and `timed_out` is set; the session stays usable (None: the daemon's
        exec.default_timeout_s, 600 s unless configured). `idle_timeout`: the same after this many
        seconds without output (None: no such limit). `output_limit`: bytes kept (None: the
        daemon's default, 1 MiB). `strip_ansi`: also return the output without ANSI escapes in
        `output_plain`. `separate_stderr`: stderr apart, in `stderr` (`output` is then stdout
        alone); by default both are the terminal, in the order written. `check`: raise
        CommandExitError unless the result is `ok`.
        """
        request = _core.build_run_in_shell_request(
            self._sandbox_id,
            self._name,
            cmd,
            timeout=timeout,
            idle_timeout=idle_timeout,
            output_limit=output_limit,
            strip_ansi=strip_ansi,
            separate_stderr=separate_stderr,
        )
        response = await self._transport.unary(
            self._transport.shell_service.RunInShell, request, timeout=_core.shell_deadline(timeout)
        )
        result = _core.shell_result_from_proto(response)
        return result.check() if check else result

    async def refresh(self) -> ShellInfo:
        """Asks the daemon about this session and returns it (also in `.info`); NotFound once the
        session is gone."""
        response = await self._transport.unary(
            self._transport.shell_service.ListShells, _core.build_list_shells_request(self._sandbox_id)
        )
        info = _core.find_shell(response, self._name)
        if info is None:
            raise NotFound(f"sandbox {self._sandbox_id} has no shell named {self._name!r}")
        self._info = info
        return info

    async def close(self) -> None:
        """Ends the session and kills everything it started. Closing a session that is already
        gone is not an error."""
        if self._closed:
            return
        try:
            await self._transport.unary(
                self._transport.shell_service.CloseShell, _core.build_close_shell_request(self._sandbox_id, self._name)
            )
        except NotFound:
            pass  # closed elsewhere, or its sandbox is gone: the goal is reached
        self._closed = True

    async def _open(self, request: object) -> None:
        """OpenShell; on ALREADY_EXISTS, attaches to the existing session instead. A session
        closed between the two calls is opened again, once."""
        for attempt in range(2):
            try:
                response = await self._transport.unary(self._transport.shell_service.OpenShell, request)
            except AlreadyExists:
                try:
                    await self.refresh()
                    return
                except NotFound:
                    if attempt:
                        raise
                    continue
            self._info = _core.shell_info_from_proto(response.shell)
            return

    async def __aenter__(self) -> AsyncShell:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await _close_after(self.close, exc, f"shell {self._name!r} of sandbox {self._sandbox_id}")

    def __repr__(self) -> str:
        return f"AsyncShell(sandbox_id={self._sandbox_id!r}, name={self._name!r})"


class AsyncKernel:
    """An IPython kernel in a sandbox (see `AsyncSandbox.kernel`). As an async context manager it
    shuts the kernel down on exit: `async with await sandbox.kernel() as kernel: ...`."""

    def __init__(self, transport: AsyncTransport, info: KernelInfo) -> None:
        self._transport = transport
        self._info = info
        self._shut_down = False

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def sandbox_id(self) -> str:
        return self._info.sandbox_id

    @property
    def info(self) -> KernelInfo:
        """What the daemon last said about this kernel; `refresh()` asks again."""
        return self._info

    async def execute(self, code: str, *, timeout: float | None = None) -> KernelResult:
        """Runs one cell and returns everything it produced. `timeout`: seconds, after which the
        kernel is interrupted and `timed_out` is set (a cell that ignores the interrupt gets the
        kernel killed: `kernel_died`); None: the daemon's exec.default_timeout_s. A cell that
        raises is not an SDK error: see `.error`; nor is one whose kernel dies: see
        `.kernel_died` and why (`.exit_code`, `.signal`, `.oom_killed`); the next cell restarts
        it (`.restarted`). Output of earlier cells that arrived after their results comes apart,
        in `.late_output`."""
        request = _core.build_execute_gathered_request(self.sandbox_id, self.id, code, timeout=timeout)
        response = await self._transport.unary(
            self._transport.kernel_service.ExecuteGathered, request, timeout=_core.kernel_deadline(timeout)
        )
        return _core.kernel_result_from_proto(response)

    def execute_stream(self, code: str, *, timeout: float | None = None) -> AsyncKernelExecuteStream:
        """Runs one cell and streams its events as the kernel sends them: KernelStreamEvent,
        KernelDisplayEvent, KernelResultEvent and KernelErrorEvent, then one KernelDoneEvent;
        first, when earlier cells printed after their results, one KernelLateOutput. Each of
        stdout and stderr is streamed up to the daemon's output cap (KernelDoneEvent.truncated).

        Closing the stream before KernelDoneEvent (or leaving its `async with` block) interrupts
        the cell. Use: `async with kernel.execute_stream(code) as events: async for e in events:
        ...`.
        """
        request = _core.build_execute_request(self.sandbox_id, self.id, code, timeout=timeout)
        return AsyncKernelExecuteStream(
            self._transport.server_stream(
                self._transport.kernel_service.Execute, request, timeout=_core.kernel_deadline(timeout)
            )
        )

    async def interrupt(self) -> None:
        """Interrupts the running cell (SIGINT to the kernel), as Jupyter's stop button does."""
        await self._transport.unary(
            self._transport.kernel_service.InterruptKernel,
            _core.build_interrupt_kernel_request(self.sandbox_id, self.id),
        )

    async def restart(self) -> KernelInfo:
        """Replaces the kernel process with a fresh one under the same id: all state is lost."""
        response = await self._transport.unary(
            self._transport.kernel_service.RestartKernel,
            _core.build_restart_kernel_request(self.sandbox_id, self.id),
            timeout=_kernel_start_deadline(self._transport),
        )
        self._info = _core.kernel_info_from_proto(response.kernel)
        return self._info

    async def refresh(self) -> KernelInfo:
        """Asks the daemon for this kernel's state and returns it (also in `.info`)."""
        self._info = await _lookup_kernel(self._transport, self.sandbox_id, self.id)
        return self._info

    async def shutdown(self) -> None:
        """Stops the kernel. Shutting down a kernel that is already gone is not an error."""
        if self._shut_down:
            return
        try:
            await self._transport.unary(
                self._transport.kernel_service.ShutdownKernel,
                _core.build_shutdown_kernel_request(self.sandbox_id, self.id),
            )
        except NotFound:
            pass  # shut down elsewhere, or its sandbox is gone: the goal is reached
        self._shut_down = True

    async def __aenter__(self) -> AsyncKernel:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await _close_after(self.shutdown, exc, f"kernel {self.id} of sandbox {self.sandbox_id}")

    def __repr__(self) -> str:
        return f"AsyncKernel(id={self.id!r}, sandbox_id={self.sandbox_id!r})"


class AsyncKernelExecuteStream(_AsyncEventStream[KernelEvent]):
    """The events of one streamed cell (see `AsyncKernel.execute_stream`). Closing it before
    KernelDoneEvent cancels the call, which interrupts the cell."""

    def __init__(self, responses: AsyncResponseStream[kernel_pb.ExecuteResponse]) -> None:
        super().__init__(responses, _core.KernelEventDecoder())


def _kernel_start_deadline(transport: AsyncTransport) -> float:
    return max(transport.default_timeout, _core.KERNEL_START_TIMEOUT_S)


async def _lookup_kernel(transport: AsyncTransport, sandbox_id: str, kernel_id: str) -> KernelInfo:
    response = await transport.unary(transport.kernel_service.ListKernels, _core.build_list_kernels_request(sandbox_id))
    info = _core.find_kernel(response, kernel_id)
    if info is None:
        raise NotFound(f"sandbox {sandbox_id} has no kernel {kernel_id!r}")
    return info


async def _close_after(close: Callable[[], Awaitable[None]], exc: BaseException | None, what: str) -> None:
    """Runs `close` when leaving its `async with` block; when the block raised, that exception is
    the one the caller needs to see, so a failure to close is only logged."""
    if exc is None:
        await close()
        return
    try:
        await close()
    except CorralError as error:
        _log.warning("could not close %s: %s", what, error)
