"""Request rules: what the daemon accepts from a caller, written once and called by the managers.

Servicers only translate messages; the managers (sandboxes, shells, kernels) check every value
here before acting, so a rule cannot differ between RPCs that share it, and a caller's mistake is
always INVALID_ARGUMENT with a message saying what to fix. Values left unset take the daemon's
configured defaults here too.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass, field
from typing import overload

from corral.sdk.errors import InvalidArgument

from .backends.base import Limits
from .config import ExecConfig, LeasesConfig, LimitsConfig
from .users import check_user_spec

MIN_MEMORY_BYTES = 4 << 20  # below this not even a shell starts
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: more than any node has, far below what the kernel and engines parse
MAX_PIDS = 4 << 20  # PID_MAX_LIMIT on 64-bit Linux: pids.max refuses anything larger
MIN_CPU_MILLICORES = 10
MAX_CPU_MILLICORES = 1024 * 1000  # 1024 cores
MIN_DISK_BYTES = 16 << 20  # the smallest filesystem worth formatting for a sandbox
MAX_DISK_BYTES = 1 << 44  # 16 TiB: the largest file (a sparse image) ext4 holds with 4 KiB blocks
MAX_IDLE_TIMEOUT_MS = 30 * 24 * 3600 * 1000  # 30 days
MAX_KEEPALIVE_MS = 3600 * 1000  # an hour
MAX_TERMINAL_SIDE = 1000
MAX_SHELL_NAME = 64
DEFAULT_SHELL_NAME = "main"


def no_nul(what: str, value: str) -> str:
    """`value`, which must not contain a NUL byte (no argv, path or script can)."""
    if "\0" in value:
        raise InvalidArgument(f"{what} contains a NUL byte")
    return value


def environment(env: Mapping[str, str]) -> dict[str, str]:
    """Environment variables: non-empty names without '=' or NUL, values without NUL."""
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidArgument(f"invalid environment variable name or value: {key!r}")
    return dict(env)


def user(spec: str) -> str:
    """Who a sandbox, a command, a shell or a kernel runs as: "" (the default), a user name, a uid
    or uid:gid (daemon/users.py); the backend resolves it against the image."""
    return check_user_spec(no_nul("user", spec))


def working_directory(cwd: str) -> str:
    """A command's working directory: "" (the sandbox's workdir) or an absolute path."""
    no_nul("cwd", cwd)
    if cwd and not cwd.startswith("/"):
        raise InvalidArgument(f"cwd must be an absolute path inside the sandbox, got {cwd!r}")
    return cwd


def command_directory(cwd: str) -> str:
    """An Exec or ExecStream command's working directory as sent: "" (the sandbox's workdir), an
    absolute path, or a path relative to the workdir, as in the file calls. The manager resolves it
    in the sandbox and refuses one that is not a directory there (ExecManager.run_command)."""
    return no_nul("cwd", cwd)


def in_range(field: str, value: int, low: int, high: int, unit: str, zero: str = "") -> int:
    """`value` when it lies in low..high (or is 0 and `zero` says what 0 means); otherwise
    INVALID_ARGUMENT naming the field and the range. Every numeric request field passes here:
    wire integers go up to 2^64-1, and none may reach a conversion, a kernel file or a reply
    unchecked."""
    if (value == 0 and zero) or low <= value <= high:
        return value
    allowed = f"{low}..{high} {unit}" + (f", or 0 ({zero})" if zero else "")
    raise InvalidArgument(f"{field} must be {allowed}; got {value}")


def timeout_s(config: ExecConfig, timeout_ms: int, field: str = "timeout_ms") -> float:
    """A wall-clock limit in seconds: 0 takes the default; more than the maximum is refused."""
    in_range(field, timeout_ms, 1, int(config.max_timeout_s * 1000), "ms", "the daemon's default")
    return timeout_ms / 1000 if timeout_ms else config.default_timeout_s


def idle_timeout_s(config: ExecConfig, idle_timeout_ms: int) -> float:
    """A limit on the time without output, in seconds (0: none), at most the daemon's maximum
    timeout."""
    in_range("idle_timeout_ms", idle_timeout_ms, 1, int(config.max_timeout_s * 1000), "ms", "no idle limit")
    return idle_timeout_ms / 1000


def output_limit(config: ExecConfig, limit_bytes: int) -> int:
    """Bytes of output kept: 0 takes the default; more than the maximum is refused."""
    in_range("output_limit_bytes", limit_bytes, 1, config.max_output_limit_bytes, "bytes", "the daemon's default")
    return limit_bytes or config.default_output_limit_bytes


def keepalive_s(interval_ms: int) -> float:
    """How often a stream without news sends a keepalive, in seconds (0: never)."""
    return in_range("keepalive_interval_ms", interval_ms, 1, MAX_KEEPALIVE_MS, "ms", "no keepalives") / 1000


def sandbox_limits(requested: Limits, defaults: LimitsConfig) -> Limits:
    """A new sandbox's limits: each 0 takes the node's default; too small to run a shell, or
    beyond what the kernel accepts, is refused."""
    in_range("limits.memory_bytes", requested.memory_bytes, MIN_MEMORY_BYTES, MAX_MEMORY_BYTES, "bytes", "the default")
    in_range("limits.pids", requested.pids, 1, MAX_PIDS, "processes", "the default")
    cpu = requested.cpu_millicores
    in_range("limits.cpu_millicores", cpu, MIN_CPU_MILLICORES, MAX_CPU_MILLICORES, "millicores", "the default")
    in_range("limits.disk_bytes", requested.disk_bytes, MIN_DISK_BYTES, MAX_DISK_BYTES, "bytes", "the default")
    return Limits(
        memory_bytes=requested.memory_bytes or defaults.memory_bytes,
        pids=requested.pids or defaults.pids,
        cpu_millicores=requested.cpu_millicores or defaults.cpu_millicores,
        disk_bytes=requested.disk_bytes or defaults.disk_bytes,
    )


def sandbox_idle_timeout_s(defaults: LimitsConfig, idle_timeout_ms: int) -> float:
    """A new sandbox's idle timeout in seconds: 0 takes the node's default (itself 0: never)."""
    in_range("idle_timeout_ms", idle_timeout_ms, 1, MAX_IDLE_TIMEOUT_MS, "ms (30 days)", "the daemon's default")
    return idle_timeout_ms / 1000 if idle_timeout_ms else defaults.idle_timeout_s


MIN_LEASE_TTL_MS = 100


def lease_ttl_s(config: LeasesConfig, ttl_ms: int, field: str = "lease_ttl_ms", *, required: bool = False) -> float:
    """A lease's TTL in seconds, MIN_LEASE_TTL_MS..leases.max_ttl_s; 0 (no lease) unless `required`."""
    high = int(config.max_ttl_s * 1000)
    in_range(field, ttl_ms, MIN_LEASE_TTL_MS, high, "ms (leases.max_ttl_s)", "" if required else "no lease")
    return ttl_ms / 1000


@overload
def terminal_size(size: tuple[int, int]) -> tuple[int, int]: ...


@overload
def terminal_size(size: None) -> None: ...


@overload
def terminal_size(size: tuple[int, int] | None) -> tuple[int, int] | None: ...


def terminal_size(size: tuple[int, int] | None) -> tuple[int, int] | None:
    """(rows, cols), each 1..1000, or None (the default size)."""
    if size is None:
        return None
    rows, cols = size
    if not (0 < rows <= MAX_TERMINAL_SIDE and 0 < cols <= MAX_TERMINAL_SIDE):
        raise InvalidArgument(f"terminal size must be 1..{MAX_TERMINAL_SIDE} rows and columns")
    return rows, cols


def shell_name(name: str) -> str:
    """A shell session's name: "" is "main"; at most 64 characters, no '/'."""
    name = name or DEFAULT_SHELL_NAME
    if "/" in name or "\0" in name or len(name) > MAX_SHELL_NAME:
        raise InvalidArgument(f"a shell name is at most {MAX_SHELL_NAME} characters, without '/'")
    return name


# Shells a session can run: bash (the full protocol) and POSIX shells (docs/shells.md).
SESSION_SHELLS = ("bash", "sh", "dash", "ash", "ksh", "mksh", "zsh")


def terminal_program(program: str) -> str:
    """The program an interactive terminal runs: "" (the sandbox's shell) or any program."""
    if program and ("\0" in program or not program.strip()):
        raise InvalidArgument("invalid shell program")
    return program


def shell_program(program: str) -> str:
    """The shell a session runs: "" (the sandbox's shell) or one of SESSION_SHELLS, by name or path."""
    terminal_program(program)
    if program and os.path.basename(program) not in SESSION_SHELLS:
        raise InvalidArgument(
            f"a shell session runs one of {', '.join(SESSION_SHELLS)} (by name or path), not {program!r}"
        )
    return program


def kernel_python(python: str) -> str:
    """A kernel's interpreter: "" (the default) or a program name or path. It is started through
    `env`, which would take a name with '=' for a variable and one with a leading '-' for an option."""
    no_nul("python", python)
    if python and (not python.strip() or "=" in python or python.startswith("-")):
        raise InvalidArgument(f"python must be a program name or path (no '=', no leading '-'), got {python!r}")
    return python


def cell_code(code: str) -> str:
    """A kernel cell's source: Python source cannot contain a NUL byte."""
    return no_nul("code", code)


def signal_number(number: int) -> int:
    """A signal to send into a terminal: 1..SIGRTMAX."""
    if not 1 <= number <= signal.SIGRTMAX:
        raise InvalidArgument(f"{number} is not a signal number")
    return number


@dataclass(frozen=True)
class CommandRequest:
    """A command as the caller sent it (Exec, ExecStream), before any rule or default."""

    argv: list[str] | None
    shell: str | None
    stdin: bytes | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = ""
    timeout_ms: int = 0
    output_limit_bytes: int = 0
    user: str = ""


@dataclass(frozen=True)
class CommandSpec:
    """A checked command request (Exec, ExecStream), with defaults applied."""

    argv: list[str] | None
    shell: str | None
    stdin: bytes | AsyncIterable[bytes] | None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    timeout_s: float = 0.0
    output_limit: int = 0
    user: str = ""  # "": the sandbox's default user


def command(config: ExecConfig, request: CommandRequest) -> CommandSpec:
    """A command to run: argv (non-empty) or a shell string, and its options."""
    argv, shell = request.argv, request.shell
    if argv is None and shell is None:
        raise InvalidArgument("command needs argv or shell")
    if argv is not None and (not argv or not argv[0]):
        raise InvalidArgument("argv is empty")
    for arg in argv or ():
        no_nul("command", arg)
    no_nul("command", shell or "")
    return CommandSpec(
        argv,
        shell,
        request.stdin,
        environment(request.env),
        command_directory(request.cwd),
        timeout_s(config, request.timeout_ms),
        output_limit(config, request.output_limit_bytes),
        user(request.user),
    )
