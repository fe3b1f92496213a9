"""ShellManager: the named shell sessions of every sandbox, and interactive attach terminals."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Literal

from corral.sdk.errors import AlreadyExists, FailedPrecondition, NotFound

from . import rules
from .commands import sandbox_environment
from .config import Config
from .files import FileManager
from .pty import Terminal
from .sandboxes import SandboxManager
from .shell_session import ShellSession, TurnResult

DEFAULT_SIZE = (40, 200)
ATTACH_SIZE = (24, 80)
MAX_SESSIONS_PER_SANDBOX = 64
# Input the program has not read after this long ends the attach with an error (backpressure).
ATTACH_INPUT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class AttachOutput:
    data: bytes


@dataclass(frozen=True)
class AttachExited:
    exit_code: int


# What the caller of an attach sends: keystrokes, a new (rows, cols), a signal number.
AttachInput = tuple[Literal["input"], bytes] | tuple[Literal["resize"], tuple[int, int]] | tuple[Literal["signal"], int]


class ShellManager:
    def __init__(self, config: Config, sandboxes: SandboxManager, files: FileManager) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self.files = files
        self._sessions: dict[str, dict[str, ShellSession]] = {}
        self._slots: dict[str, int] = {}
        sandboxes.on_destroy(self.close_sandbox)

    @staticmethod
    def _program(runtime, program: str) -> str:
        # By name by default, found on the sandbox's PATH, so that the shell calls itself `bash`
        # in its messages, as `bash -c` does.
        return rules.shell_program(program) or os.path.basename(runtime.shell_argv("")[0])

    @staticmethod
    def _terminal_program(runtime, program: str) -> str:
        return rules.terminal_program(program) or runtime.shell_argv("")[0]

    async def open(
        self,
        sandbox_id: str,
        name: str,
        *,
        env: dict[str, str],
        cwd: str,
        size: tuple[int, int] | None,
        program: str,
        user: str = "",
    ) -> ShellSession:
        """Starts a named session as `user` ("": the sandbox's default user)."""
        name = rules.shell_name(name)
        user = rules.user(user)
        cwd = rules.working_directory(cwd)
        env = rules.environment(env)
        size = rules.terminal_size(size)
        with self.sandboxes.using(sandbox_id) as sandbox:
            sessions = self._sessions.setdefault(sandbox_id, {})
            if name in sessions:
                raise AlreadyExists(f"sandbox {sandbox_id} already has a shell named {name!r}")
            if len(sessions) >= MAX_SESSIONS_PER_SANDBOX:
                raise FailedPrecondition(f"sandbox {sandbox_id} already has {MAX_SESSIONS_PER_SANDBOX} shells")
            cwd = await self.files.command_directory(sandbox, cwd)
            runtime = sandbox.runtime
            slot = self._slots[sandbox_id] = self._slots.get(sandbox_id, 0) + 1
            rows, cols = size or DEFAULT_SIZE
            session = ShellSession(
                runtime,
                name,
                env=sandbox_environment(runtime.home(user), sandbox.env, env),
                cwd=cwd,
                rows=rows,
                cols=cols,
                program=self._program(runtime, program),
                slot=slot,
                user=user,
            )
            sessions[name] = session  # reserve the name while the shell starts
            try:
                await session.start()
            except BaseException as err:
                sessions.pop(name, None)
                await session.close()
                if isinstance(err, RuntimeError):
                    raise FailedPrecondition(f"could not start {session.program!r} in {sandbox_id}: {err}") from err
                raise
            return session

    def get(self, sandbox_id: str, name: str) -> ShellSession:
        self.sandboxes.get(sandbox_id)  # NOT_FOUND for an unknown sandbox first
        name = name or rules.DEFAULT_SHELL_NAME
        session = self._sessions.get(sandbox_id, {}).get(name)
        if session is None:
            raise NotFound(f"sandbox {sandbox_id} has no shell named {name!r}")
        return session

    async def run(
        self,
        sandbox_id: str,
        name: str,
        command: str,
        *,
        timeout_ms: int,
        idle_timeout_ms: int,
        output_limit_bytes: int,
        strip_ansi: bool,
        separate_stderr: bool = False,
    ) -> tuple[TurnResult, bytes | None]:
        """Runs one command in a session. Timeouts and the output limit as the caller sent them
        (0: the daemon's defaults; idle timeout 0: none)."""
        config = self.config.exec
        timeout_s = rules.timeout_s(config, timeout_ms)
        idle_timeout_s = rules.idle_timeout_s(config, idle_timeout_ms)
        limit = rules.output_limit(config, output_limit_bytes)
        rules.no_nul("command", command)
        session = self.get(sandbox_id, name)
        with self.sandboxes.using(sandbox_id):
            return await session.run(
                command,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                output_limit=limit,
                strip=strip_ansi,
                separate_stderr=separate_stderr,
            )

    def list(self, sandbox_id: str) -> list[ShellSession]:
        self.sandboxes.get(sandbox_id)
        return list(self._sessions.get(sandbox_id, {}).values())

    async def close_shell(self, sandbox_id: str, name: str) -> None:
        session = self.get(sandbox_id, name)
        self._sessions[sandbox_id].pop(session.name, None)
        await session.close()

    async def close_sandbox(self, sandbox_id: str) -> None:
        sessions = self._sessions.pop(sandbox_id, {})
        self._slots.pop(sandbox_id, None)
        await asyncio.gather(*(s.close() for s in sessions.values()), return_exceptions=True)

    async def close(self) -> None:
        await asyncio.gather(*(self.close_sandbox(sid) for sid in list(self._sessions)), return_exceptions=True)

    # -- interactive terminals -----------------------------------------------------------------------

    async def attach(
        self,
        sandbox_id: str,
        *,
        size: tuple[int, int] | None,
        term: str,
        program: str,
        inputs: AsyncIterator[AttachInput],
        user: str = "",
    ) -> AsyncGenerator[AttachOutput | AttachExited, None]:
        """An interactive shell, as `user` ("": the sandbox's default user), for as long as the
        caller iterates. `inputs` yields ("input", bytes), ("resize", (rows, cols)) and ("signal",
        number), as the caller sent them."""
        size = rules.terminal_size(size)
        user = rules.user(user)
        with self.sandboxes.using(sandbox_id) as sandbox:
            runtime = sandbox.runtime
            env = sandbox_environment(runtime.home(user), sandbox.env, {"TERM": term or "xterm-256color"})
            env.pop("PAGER", None)
            env.pop("GIT_PAGER", None)
            rows, cols = size or ATTACH_SIZE
            enter = runtime.enter_command(
                [self._terminal_program(runtime, program)], cwd="", leaf=runtime.next_leaf("at"), env=env, user=user
            )
            terminal = Terminal.entering(enter, rows=rows, cols=cols, interactive=True)
            queue: asyncio.Queue[bytes] = asyncio.Queue()
            terminal.attach(queue.put_nowait)

            async def pump_inputs() -> None:
                async for item in inputs:
                    if item[0] == "input":
                        await terminal.write(item[1], timeout=ATTACH_INPUT_TIMEOUT_S)
                    elif item[0] == "resize":
                        terminal.resize(*rules.terminal_size(item[1]))
                    elif item[0] == "signal":
                        terminal.signal_inner(rules.signal_number(item[1]), spare={terminal.shell_pid() or 0})

            # The client half-closing its side only means "no more input": the terminal lives
            # until the shell exits or the call is cancelled.
            feeder = asyncio.ensure_future(pump_inputs())
            getter: asyncio.Future | None = None
            try:
                while True:
                    getter = asyncio.ensure_future(queue.get())
                    waiting = {getter, terminal.exited} | (set() if feeder.done() else {feeder})
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if feeder.done() and (error := feeder.exception()) is not None:
                        raise error
                    if getter.done():
                        yield AttachOutput(getter.result())
                        continue
                    getter.cancel()
                    if terminal.exited.done():
                        terminal.drain(terminal.master, queue.put_nowait)
                        while not queue.empty():
                            yield AttachOutput(queue.get_nowait())
                        yield AttachExited(terminal.exited.result())
                        return
            finally:
                if getter is not None:
                    getter.cancel()
                feeder.cancel()
                await terminal.close()
