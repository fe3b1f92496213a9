"""Running a harness task's command: on the node (an asyncio subprocess in a process group of its
own) or inside the task's sandbox (a background process of the SDK).

Either way the command runs until it exits; cancelling the coroutine (the RUN timeout, a client's
cancel, shutdown) kills it and everything it started before the cancellation goes on: on the host
the whole process group gets SIGTERM, then SIGKILL after a short grace, and is reaped; in the
sandbox the daemon kills the process and what it left. What it printed last is kept (bounded) for
the error of a failed run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from corral.rollout.tasks import runs_on_host, task_prompt_text
from corral.sdk import AsyncSandbox, InvalidArgument
from corral.v1 import rollout_pb2 as pb

# How much of the end of each output stream is kept for the error message.
OUTPUT_TAIL_BYTES = 64 << 10
# Between SIGTERM and SIGKILL for a host harness's process group.
KILL_GRACE_S = 2.0
# The daemon's variables a host harness inherits (nothing else of the daemon's environment).
HOST_BASE_VARIABLES = ("PATH", "HOME", "LANG")


@dataclass(frozen=True)
class HarnessExit:
    """How a harness run ended. `started` False: the command could not be started at all
    (`output` says why)."""

    started: bool
    exit_code: int
    output: str

    @property
    def succeeded(self) -> bool:
        return self.started and self.exit_code == 0

    def describe(self) -> str:
        """A line for the result's error, with the end of the output."""
        if not self.started:
            head = "the harness could not be started"
        else:
            head = f"the harness exited {self.exit_code}"
        return f"{head}: {self.output}" if self.output else head


@dataclass(frozen=True)
class GatewayAddress:
    """How a harness reaches its gateway session."""

    base_url: str  # ends in /v1
    key: str
    model: str


# sandbox id -> a context in which the gateway is reachable from inside that sandbox, yielding the
# base URL to use there (ending in /v1).
SandboxGatewayFn = Callable[[str], AbstractAsyncContextManager[str]]


@dataclass(frozen=True)
class HarnessHost:
    """What the daemon provides to run harness tasks."""

    # The gateway's base URL on the node (host harnesses use it).
    host_url: str
    # The daemon's address for the SDK (CORRAL_ADDRESS).
    daemon_address: str
    # How a sandbox's harness reaches the gateway.
    sandbox_gateway: SandboxGatewayFn
    model_name: str = "corral"


async def run_harness(
    task: pb.Task, sandbox: AsyncSandbox, *, rollout_id: str, key: str, host: HarnessHost
) -> HarnessExit:
    """Runs a harness task's command where the task says, talking to the gateway session `key`,
    until it exits (cancel it to kill it)."""
    harness = task.harness
    workdir_in_sandbox = sandbox.info.workdir

    def environment(base_url: str, workdir: str) -> dict[str, str]:
        return harness_environment(
            GatewayAddress(base_url, key, host.model_name),
            rollout_id=rollout_id,
            sandbox_id=sandbox.id,
            daemon_address=host.daemon_address,
            task_prompt=task_prompt_text(task),
            workdir=workdir,
            task_env=harness.env,
        )

    if runs_on_host(task):
        env = {**host_base_environment(), **environment(host.host_url, workdir_in_sandbox)}
        if harness.workdir:
            return await run_on_host(harness.command, env, harness.workdir)
        scratch = tempfile.mkdtemp(prefix="corral-harness-")
        try:
            return await run_on_host(harness.command, env, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    async with host.sandbox_gateway(sandbox.id) as base_url:
        env = environment(base_url, workdir_in_sandbox)
        return await run_in_sandbox(sandbox, harness.command, env, harness.workdir or None)


def harness_environment(
    gateway: GatewayAddress,
    *,
    rollout_id: str,
    sandbox_id: str,
    daemon_address: str,
    task_prompt: str,
    workdir: str,
    task_env: Mapping[str, str],
) -> dict[str, str]:
    """The variables a harness gets (the task's own env last, so it may override them): the
    gateway as each API's clients look for it (OpenAI's base URL ends in /v1; Anthropic's and
    Gemini's SDKs add their own paths to the server's root), with the session's key."""
    root = gateway.base_url.removesuffix("/v1")
    return {
        "OPENAI_BASE_URL": gateway.base_url,
        "OPENAI_API_BASE": gateway.base_url,
        "OPENAI_API_KEY": gateway.key,
        "ANTHROPIC_BASE_URL": root,
        "ANTHROPIC_API_KEY": gateway.key,
        "GOOGLE_GEMINI_BASE_URL": root,
        "GEMINI_API_KEY": gateway.key,
        "CORRAL_GATEWAY_URL": root,
        "CORRAL_MODEL": gateway.model,
        "CORRAL_ROLLOUT_ID": rollout_id,
        "CORRAL_SANDBOX_ID": sandbox_id,
        "CORRAL_ADDRESS": daemon_address,
        "CORRAL_TASK_PROMPT": task_prompt,
        "CORRAL_WORKDIR": workdir,
        **task_env,
    }


def host_base_environment() -> dict[str, str]:
    return {name: os.environ[name] for name in HOST_BASE_VARIABLES if name in os.environ}


class _Tail:
    """The last `limit` bytes written to it."""

    def __init__(self, limit: int = OUTPUT_TAIL_BYTES) -> None:
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._limit = limit

    def add(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        while self._size - len(self._chunks[0]) >= self._limit:
            self._size -= len(self._chunks.popleft())

    def text(self) -> str:
        return b"".join(self._chunks)[-self._limit :].decode(errors="replace").strip()


async def _drain(stream: asyncio.StreamReader, tail: _Tail) -> None:
    while data := await stream.read(1 << 16):
        tail.add(data)


async def run_on_host(argv: Sequence[str], env: Mapping[str, str], workdir: str) -> HarnessExit:
    """Runs argv on the node in a new session (its own process group) with exactly `env`."""
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=dict(env),
            cwd=workdir,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as error:
        return HarnessExit(False, -1, f"{argv[0]}: {error.strerror or error}")
    assert process.stdout is not None and process.stderr is not None
    stdout, stderr = _Tail(), _Tail()
    readers = [
        asyncio.ensure_future(_drain(process.stdout, stdout)),
        asyncio.ensure_future(_drain(process.stderr, stderr)),
    ]
    try:
        code = await process.wait()
    finally:
        # Whatever it left running goes with it, whichever way this ends; a cancellation waits
        # here (shielded) until the group is gone.
        await asyncio.shield(_end_group(process))
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    output = stderr.text() or stdout.text()
    return HarnessExit(True, code, output)


async def _end_group(process: asyncio.subprocess.Process) -> None:
    """Ends the process group and reaps the leader: while the leader runs (a timeout, a cancel),
    SIGTERM, then SIGKILL after KILL_GRACE_S to what is left; once it has exited, what it left
    behind gets SIGKILL at once (the harness is done with it)."""
    group = process.pid  # start_new_session: the leader's pid is the group's id
    if process.returncode is None and _signal_group(group, signal.SIGTERM):
        deadline = asyncio.get_running_loop().time() + KILL_GRACE_S
        while asyncio.get_running_loop().time() < deadline:
            if process.returncode is not None and not _signal_group(group, 0):
                return
            await asyncio.sleep(0.05)
    _signal_group(group, signal.SIGKILL)
    await process.wait()
    # SIGKILL takes effect asynchronously: give the rest of the group a moment to be gone (an
    # orphan stays listed as a zombie until its new parent reaps it, hence the bound).
    for _ in range(20):
        if not _signal_group(group, 0):
            break
        await asyncio.sleep(0.025)


def _signal_group(group: int, number: int) -> bool:
    """False when the group has no process left."""
    try:
        os.killpg(group, number)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def run_in_sandbox(
    sandbox: AsyncSandbox, argv: Sequence[str], env: Mapping[str, str], workdir: str | None
) -> HarnessExit:
    """Runs argv inside the sandbox as a background process (the sandbox's own environment, plus
    `env`). Raises the SDK's errors when the sandbox fails; an argv the daemon refuses is a run
    that could not start."""
    try:
        process = await sandbox.start_process(list(argv), env=dict(env), cwd=workdir, buffer_size=OUTPUT_TAIL_BYTES)
    except InvalidArgument as error:
        return HarnessExit(False, -1, str(error))
    try:
        info = await process.wait()
        # The daemon kept the last OUTPUT_TAIL_BYTES of the output (a pty's: stdout and stderr
        # together); the read starts at the oldest byte it still has.
        tail = _Tail()
        while process.offset < info.output_end:
            output = await process.read()
            if not output.data:
                break
            tail.add(output.data)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(process.close())
    return HarnessExit(True, info.exit_code, tail.text())
