"""SWE-ReX on corral: `CorralRuntime`, a runtime of SWE-ReX's (its `AbstractRuntime`) whose sessions
and commands run in a corral sandbox, and `CorralDeployment`, the deployment that creates that
sandbox. `corral swerex-serve` (swerex_server.py) serves a CorralRuntime over SWE-ReX's HTTP
protocol, so that SWE-ReX's own RemoteRuntime, and SWE-agent with `deployment: remote`, use it
unchanged.

    from corral.integrations.swerex import CorralDeployment
    deployment = CorralDeployment(backend="docker", image="python:3.12")
    await deployment.start()
    runtime = deployment.runtime          # create_session, run_in_session, execute, ...

How SWE-ReX's requests map onto corral:
- A session (`create_session`) is a corral shell session: a command (`BashAction`) is one shell
  turn, with its exit code read by the daemon rather than parsed from a prompt; `check` is
  SWE-ReX's ("raise": NonZeroExitCodeError, "silent": the exit code, "ignore": None). On timeout
  the daemon interrupts the command and the session stays usable: CommandTimeoutError, with the
  output written so far in its `extra_info["output"]`.
- An interactive action (`is_interactive_command`, `is_interactive_quit`: a REPL, gdb) runs the
  program as a background process of the sandbox on a terminal of its own (the SDK's
  non-blocking process API), started in the session's cwd with its exported variables; later
  interactive actions type into it and wait (`expect`) for one of the action's patterns, regular
  expressions as in SWE-ReX, or for the program's end, which plays the part of SWE-ReX's prompt.
- `BashInterruptAction`: ^C to the interactive program (then, after `n_retry` tries, it is
  killed); with none, nothing runs in the session any more (a timed-out command was already
  interrupted), so it answers at once.
- `execute` is one exec; `read_file`, `write_file` and `upload` go to exactly the sandbox path
  asked for (relative paths: relative to the sandbox's workdir).
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import re
import secrets
import shlex
import shutil
import weakref
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from swerex.utils.log import get_logger

from corral.sdk import AsyncClient, AsyncProcess, AsyncSandbox, AsyncShell, Client, CorralError, ExpectFailed, NotFound
from corral.sdk.ansi import strip_ansi
from corral.sdk.errors import PermissionDenied

# The label every sandbox of CorralDeployment carries (`corral sandbox ls`, list_sandboxes(labels=...)).
HARNESS_LABEL = "corral.harness"
HARNESS_NAME = "swe-rex"
# What an observation names as the matched pattern when the interactive program ended: the prompt
# SWE-ReX's own sessions wait for, which the shell shows again at that point.
PROMPT = "SHELLPS1PREFIX"
# Seconds a command of a session or `execute` may run when the request says None ("no timeout"):
# the daemon needs a bound; this one is longer than any SWE-agent step.
NO_TIMEOUT_S = 24 * 3600.0
# Seconds for the small shell turns this module adds itself (saving a session's state).
INTERNAL_TURN_S = 30.0
# Runs the rest of argv with stderr on stdout's pipe (`merge_output_streams`).
_MERGED_OUTPUT = ("sh", "-c", 'exec 2>&1; exec "$@"', "sh")
# Moves an upload from its staging directory ($3) to the exact path asked for: $1 to $2, merged
# into $2 when both are directories (as an upload under the same name merges), then drops $3.
_MOVE_STAGED = (
    'if [ -d "$1" ] && [ -d "$2" ]; then cp -a -- "$1"/. "$2"/; '
    'else mkdir -p -- "$(dirname -- "$2")" && mv -T -- "$1" "$2"; fi; s=$?; rm -rf -- "$3"; exit $s'
)
# Matches nothing: an interactive action without patterns waits for the program's end alone.
_NEVER = re.compile(r"(?!)")
# Where the staging copies of `upload` and the saved state of a session go inside the sandbox.
_SCRATCH = "/tmp"


class CorralRuntime(AbstractRuntime):
    """SWE-ReX's AbstractRuntime over one corral sandbox (see the module's doc). The sandbox
    belongs to the caller (CorralDeployment destroys the one it made); `close()` ends this
    runtime's sessions and programs only.

    `check_syntax`: refuse a session command that bash cannot parse (BashIncorrectSyntaxError,
    before any of it runs), as SWE-ReX's sessions do; the check is `bash -n` on this host."""

    def __init__(
        self, sandbox: AsyncSandbox, *, check_syntax: bool = True, logger: logging.Logger | None = None
    ) -> None:
        self._sandbox = sandbox
        self._check_syntax = check_syntax
        self._sessions: dict[str, _Session] = {}
        # Shell names of this runtime's sessions: unique per runtime, so two runtimes on one
        # sandbox (two servers, a server and a script) never share a shell.
        self._prefix = f"swerex-{secrets.token_hex(4)}-"
        self.logger = logger or get_logger("rex-runtime")

    @property
    def sandbox(self) -> AsyncSandbox:
        """The corral sandbox everything runs in (files, shells, kernels: the whole SDK)."""
        return self._sandbox

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            info = await asyncio.wait_for(self._sandbox.refresh(), timeout)
        except (CorralError, TimeoutError) as error:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self._sandbox.id}: {error}")
        if info.state != "running":
            return IsAliveResponse(is_alive=False, message=f"sandbox {self._sandbox.id} is {info.state}")
        return IsAliveResponse(is_alive=True)

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        shell = await self._sandbox.shell(self._prefix + request.session)
        session = _Session(shell)
        self._sessions[request.session] = session
        output = ""
        for path in request.startup_source:
            result = await shell.run(f"source {shlex.quote(path)}", timeout=request.startup_timeout, strip_ansi=True)
            output += _text(result.output_plain or b"")
            if result.timed_out:
                raise _timeout(f"timeout after {request.startup_timeout} seconds while sourcing {path!r}", output)
        return CreateBashSessionResponse(output=output)

    async def run_in_session(self, action: Action) -> Observation:
        session = self._session(action.session)
        async with session.lock:
            if isinstance(action, BashInterruptAction):
                return await session.interrupt(action)
            if action.is_interactive_command or action.is_interactive_quit or session.program is not None:
                return await session.run_interactive(action, self._sandbox)
            return await self._run_normal(session, action)

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        session = self._session(request.session)
        del self._sessions[request.session]
        await session.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        timeout = command.timeout if command.timeout is not None else NO_TIMEOUT_S
        result = await self._sandbox.exec(_argv(command), env=command.env, cwd=command.cwd, timeout=timeout)
        response = CommandResponse(
            stdout=result.stdout.decode(errors="backslashreplace"),
            stderr=result.stderr.decode(errors="backslashreplace"),
            exit_code=result.exit_code,
        )
        if result.timed_out:
            error = CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
            error.extra_info = {"stdout": response.stdout, "stderr": response.stderr}  # type: ignore[attr-defined, unused-ignore]
            raise error
        if command.check and result.exit_code != 0:
            message = (
                f"Command {command.command!r} failed with exit code {result.exit_code}. "
                f"Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}"
            )
            raise NonZeroExitCodeError(f"{command.error_msg}: {message}" if command.error_msg else message)
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        data = await _file_call(request.path, self._sandbox.read_file(request.path))
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await _file_call(request.path, self._sandbox.write_file(request.path, request.content, make_parents=True))
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copies a host file or directory to exactly `target_path` in the sandbox (its parents
        created); a directory onto an existing directory merges into it."""
        source = Path(request.source_path)
        if not source.exists():
            raise FileNotFoundError(f"{source} does not exist")
        target = posixpath.normpath(request.target_path)
        if source.name == posixpath.basename(target):
            await self._sandbox.upload(source, posixpath.dirname(target) or ".")
            return UploadResponse()
        # Another name: into a staging directory of the sandbox, then moved to the exact path.
        staging = f"{_SCRATCH}/.corral-swerex-upload-{secrets.token_hex(8)}"
        staged = await self._sandbox.upload(source, staging)
        moved = await self._sandbox.exec(
            ["sh", "-c", _MOVE_STAGED, "sh", staged, target, staging], timeout=INTERNAL_TURN_S
        )
        if not moved.ok:
            raise OSError(f"upload to {target} failed: {_text(moved.stdout + moved.stderr).strip()}")
        return UploadResponse()

    async def close(self) -> CloseResponse:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
        return CloseResponse()

    def _session(self, name: str) -> _Session:
        session = self._sessions.get(name)
        if session is None:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return session

    async def _run_normal(self, session: _Session, action: BashAction) -> BashObservation:
        if self._check_syntax:
            await _check_bash_syntax(action.command)
        timeout = action.timeout if action.timeout is not None else NO_TIMEOUT_S
        result = await session.shell.run(action.command, timeout=timeout, strip_ansi=True)
        output = _text(result.output_plain or b"")
        if result.shell_restarted:
            self.logger.warning(
                "the shell of session %r was restarted: its cwd and variables are reset", action.session
            )
        if result.timed_out:
            raise _timeout(f"timeout after {action.timeout} seconds while running command {action.command!r}", output)
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None, expect_string=PROMPT)
        if action.check == "raise" and result.exit_code != 0:
            message = (
                f"Command {action.command!r} failed with exit code {result.exit_code}. Here is the output:\n{output!r}"
            )
            raise NonZeroExitCodeError(f"{action.error_msg}: {message}" if action.error_msg else message)
        return BashObservation(output=output, exit_code=result.exit_code, expect_string=PROMPT)


class _Session:
    """One SWE-ReX session: its corral shell, and the interactive program running in it, if any."""

    def __init__(self, shell: AsyncShell) -> None:
        self.shell = shell
        self.program: AsyncProcess | None = None
        # One action at a time per session, as on SWE-ReX's single pexpect terminal.
        self.lock = asyncio.Lock()

    async def run_interactive(self, action: BashAction, sandbox: AsyncSandbox) -> BashObservation:
        if self.program is None:
            if action.is_interactive_quit:  # nothing to quit: the prompt is already there
                return BashObservation(output="", exit_code=0, expect_string=PROMPT)
            self.program = await self._start_program(action.command, sandbox)
        else:
            await self.program.write(action.command + "\n")
        timeout = action.timeout if action.timeout is not None else NO_TIMEOUT_S
        output, matched = await self._expect(action.expect, timeout, action.command)
        if action.is_interactive_command:
            # The terminal echoes what was typed: SWE-ReX drops it from the output the same way.
            output = output.lstrip().removeprefix(action.command).strip()
        return BashObservation(output=output, exit_code=0, expect_string=matched)

    async def interrupt(self, action: BashInterruptAction) -> BashObservation:
        program = self.program
        if program is None:
            return BashObservation(output="", exit_code=0, expect_string=PROMPT)
        output = ""
        for _ in range(action.n_retry):
            await program.write("\x03")
            try:
                text, matched = await self._expect(action.expect, action.timeout, "^C")
            except CommandTimeoutError as error:
                output += error.extra_info["output"]  # type: ignore[attr-defined, unused-ignore]
                continue
            return BashObservation(output=(output + text).strip(), exit_code=0, expect_string=matched)
        # The program ignores ^C: killed, as SWE-ReX's session kills the job it puts in the background.
        await self._end_program()
        return BashObservation(output=(output + "\nKilled").strip(), exit_code=0, expect_string=PROMPT)

    async def close(self) -> None:
        await self._end_program()
        await self.shell.close()

    async def _start_program(self, command: str, sandbox: AsyncSandbox) -> AsyncProcess:
        """Starts `command` as a program on a terminal of its own, in the session's cwd and with
        its exported variables (saved by a shell turn to a file the program's shell sources)."""
        state = f"{_SCRATCH}/.corral-swerex-state-{secrets.token_hex(8)}"
        saved = await self.shell.run(
            f"{{ export -p; printf 'cd -- %q\\n' \"$PWD\"; }} > {state}", timeout=INTERNAL_TURN_S
        )
        if not saved.ok:
            raise OSError(f"could not save the session's state: {_text(saved.output).strip()}")
        # `set -m`: the program runs as the terminal's foreground job, so a ^C typed on the
        # terminal reaches it (and what it started) alone, not the shell and launcher above it.
        script = f'. {state} 2>/dev/null; rm -f {state}; set -m; eval "$1"; exit $?'
        return await sandbox.start_process(["bash", "-c", script, "bash", command], interactive=True)

    async def _expect(self, patterns: list[str], timeout: float, command: str) -> tuple[str, str]:
        """Waits for one of `patterns` (regular expressions, as pexpect takes them) or the
        program's end; returns the output before it and the pattern (PROMPT for the end)."""
        program = self.program
        assert program is not None
        compiled = [re.compile(pattern) for pattern in patterns] or [_NEVER]
        try:
            match = await program.expect(compiled, timeout=timeout)
        except ExpectFailed as failed:
            if failed.ended or not (await program.poll()).running:
                text = failed.text + await _drain(program)
                await self._end_program()
                return _terminal_text(text), PROMPT
            raise _timeout(
                f"timeout after {timeout} seconds while running command {command!r}", _terminal_text(failed.text)
            ) from None
        return _terminal_text(match.string[: match.start()]), patterns[compiled.index(match.re)]

    async def _end_program(self) -> None:
        program, self.program = self.program, None
        if program is not None:
            await program.close()


class CorralDeploymentConfig(BaseModel):
    """The options of CorralDeployment; an unknown key is refused."""

    model_config = ConfigDict(extra="forbid")

    image: str | None = None
    """An image name (docker), "host" or a root filesystem directory (local); None: the daemon's
    default image of the backend."""
    backend: str | None = None
    """"local", "docker" or "singularity"; None: the daemon's default."""
    memory_bytes: int | None = None
    pids: int | None = None
    cpu_millicores: int | None = None
    disk_bytes: int | None = None
    """Limits of the sandbox; None: the daemon's defaults."""
    network: bool = False
    """Give the sandbox a network (corral's default is none: loopback only)."""
    env: dict[str, str] = {}
    """Variables of every command, session and program of the sandbox."""
    user: str | None = None
    """Who commands, sessions and programs run as: a user name of the image, a uid or "uid:gid";
    None: the sandbox's default (docs/backends.md)."""
    labels: dict[str, str] = {}
    """More labels for the sandbox, beside corral.harness=swe-rex."""
    idle_timeout: float = 1800.0
    """Seconds without calls after which the daemon destroys the sandbox by itself, so that a
    harness that died leaks nothing; 0: the daemon's default."""
    startup_timeout: float = 120.0
    """Seconds the sandbox may take to start, an image pull included."""
    address: str | None = None
    """The daemon; None: $CORRAL_ADDRESS, else $CORRAL_SOCKET, else the default socket."""
    check_syntax: bool = True
    """Refuse session commands bash cannot parse (BashIncorrectSyntaxError), as SWE-ReX does."""

    type: Literal["corral"] = "corral"
    """The kind of deployment, as SWE-ReX's deployment configs name theirs."""

    def get_deployment(self) -> CorralDeployment:
        return CorralDeployment.from_config(self)


class CorralDeployment(AbstractDeployment):
    """SWE-ReX's AbstractDeployment: `start()` creates a corral sandbox (labelled
    corral.harness=swe-rex, with an idle timeout as a safety net) and a CorralRuntime on it;
    `stop()` closes the runtime and destroys the sandbox. A deployment that is never stopped
    (mini-swe-agent's SwerexDockerEnvironment never calls `stop()`) destroys its sandbox when it
    is garbage-collected or at interpreter exit, whichever comes first."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = CorralDeploymentConfig(**kwargs)
        self.logger = logger or get_logger("rex-deploy")
        self._hooks = CombinedDeploymentHook()
        self._client: AsyncClient | None = None
        self._runtime: CorralRuntime | None = None
        self._left_behind: weakref.finalize | None = None

    @classmethod
    def from_config(cls, config: CorralDeploymentConfig) -> CorralDeployment:
        return cls(**config.model_dump(exclude={"type"}))

    def __del__(self) -> None:
        # SWE-ReX's own __del__ schedules stop() on the current event loop, or runs it on a loop
        # that is not this client's: the sandbox outlived the deployment. Destroy it directly.
        left_behind = getattr(self, "_left_behind", None)
        if left_behind is not None:
            left_behind()

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> CorralRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    @property
    def sandbox(self) -> AsyncSandbox:
        return self.runtime.sandbox

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._runtime is not None:
            return
        config = self._config
        self._hooks.on_custom_step("Starting corral sandbox")
        client = AsyncClient(config.address)
        try:
            sandbox = await client.create_sandbox(
                image=config.image,
                backend=config.backend,
                memory_bytes=config.memory_bytes,
                pids=config.pids,
                cpu_millicores=config.cpu_millicores,
                disk_bytes=config.disk_bytes,
                network=config.network,
                env=config.env,
                user=config.user,
                labels={**config.labels, HARNESS_LABEL: HARNESS_NAME},
                idle_timeout=config.idle_timeout or None,
                timeout=config.startup_timeout,
            )
        except BaseException:
            await client.close()
            raise
        self._client = client
        self._runtime = CorralRuntime(sandbox, check_syntax=config.check_syntax, logger=self.logger)
        # Synchronous, with a client of its own: it may run where no event loop does.
        self._left_behind = weakref.finalize(self, _destroy_left_behind, client.address, sandbox.id, self.logger)
        self.logger.info("Started corral sandbox %s (%s)", sandbox.id, sandbox.info.backend)

    async def stop(self) -> None:
        """Closes the runtime and destroys the sandbox; stopping twice (or before start) does nothing."""
        runtime, client = self._runtime, self._client
        self._runtime = self._client = None
        if self._left_behind is not None:
            self._left_behind.detach()
        if runtime is None or client is None:
            return
        try:
            await runtime.close()
        except CorralError as error:  # the sandbox may be gone already; destroying it is what matters
            self.logger.warning("closing the sessions of sandbox %s: %s", runtime.sandbox.id, error)
        try:
            await runtime.sandbox.destroy()
        except CorralError as error:  # the idle timeout still destroys it
            self.logger.warning("could not destroy corral sandbox %s: %s", runtime.sandbox.id, error)
        finally:
            await client.close()


def _destroy_left_behind(address: str, sandbox_id: str, logger: logging.Logger) -> None:
    """Destroys the sandbox of a deployment that was dropped without `stop()`."""
    try:
        with Client(address) as client:
            client.get_sandbox(sandbox_id).destroy()
        logger.info("destroyed corral sandbox %s: its deployment was dropped without stop()", sandbox_id)
    except NotFound:
        pass
    except CorralError as error:  # the idle timeout still destroys it
        logger.warning("could not destroy corral sandbox %s left by its deployment: %s", sandbox_id, error)


def _argv(command: Command) -> list[str]:
    """`Command.command` as subprocess.run takes it: with `shell`, a /bin/sh command line (a list:
    the line and the shell's arguments); without, an argv (a str: the program's name)."""
    if command.shell:
        parts = [command.command] if isinstance(command.command, str) else list(command.command)
        argv = ["/bin/sh", "-c", *parts]
    else:
        argv = [command.command] if isinstance(command.command, str) else list(command.command)
    return [*_MERGED_OUTPUT, *argv] if command.merge_output_streams else argv


async def _check_bash_syntax(command: str) -> None:
    """SWE-ReX's check before a session command runs: BashIncorrectSyntaxError, with bash's
    stdout and stderr in `extra_info`, when `bash -n` refuses it."""
    process = await asyncio.create_subprocess_exec(
        shutil.which("bash") or "/bin/bash",
        "-n",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate(command.encode() + b"\n")
    if process.returncode == 0:
        return
    stdout, stderr = out.decode(errors="backslashreplace"), err.decode(errors="backslashreplace")
    raise BashIncorrectSyntaxError(
        f"Error (exit code {process.returncode}) while checking bash command \n{command!r}\n"
        f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}",
        extra_info={"bash_stdout": stdout, "bash_stderr": stderr},
    )


async def _file_call(path: str, call: Any) -> Any:
    """A file call of the SDK, its errors as the builtin ones SWE-ReX's runtime raises."""
    try:
        return await call
    except NotFound as error:
        raise FileNotFoundError(2, f"No such file or directory: {error}", path) from None
    except PermissionDenied as error:
        raise PermissionError(13, f"Permission denied: {error}", path) from None


async def _drain(program: AsyncProcess) -> str:
    """What the program wrote that has not been read yet."""
    chunks = []
    while program.offset < program.info.output_end:
        chunks.append((await program.read()).data)
    return _text(b"".join(chunks))


def _timeout(message: str, output: str) -> CommandTimeoutError:
    """SWE-ReX's timeout error, carrying the output written until then in `extra_info["output"]`
    (a remote client gets `extra_info` too)."""
    error = CommandTimeoutError(message)
    error.extra_info = {"output": output}  # type: ignore[attr-defined, unused-ignore]
    return error


def _text(data: bytes) -> str:
    return data.decode(errors="backslashreplace").replace("\r\n", "\n")


def _terminal_text(text: str) -> str:
    """A terminal's text as SWE-ReX returns it: escape sequences dropped, CRLF as LF."""
    return strip_ansi(text.encode()).decode().replace("\r\n", "\n")


__all__ = ["CorralDeployment", "CorralDeploymentConfig", "CorralRuntime"]
