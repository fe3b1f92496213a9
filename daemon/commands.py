"""Validated command requests, independent of the wire format."""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass, field

from .config import ExecConfig
from corral.sdk.errors import InvalidArgument

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class CommandSpec:
    argv: list[str] | None
    shell: str | None
    stdin: bytes | AsyncIterable[bytes] | None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    timeout_s: float = 0.0
    output_limit: int = 0

    @classmethod
    def validated(
        cls,
        exec_config: ExecConfig,
        *,
        argv: list[str] | None,
        shell: str | None,
        stdin: bytes | None,
        env: dict[str, str],
        cwd: str,
        timeout_ms: int,
        output_limit_bytes: int,
    ) -> "CommandSpec":
        if argv is None and shell is None:
            raise InvalidArgument("command has neither argv nor shell")
        if argv is not None and (not argv or not argv[0]):
            raise InvalidArgument("argv is empty")
        if any("\0" in a for a in (argv or [])) or (shell and "\0" in shell):
            raise InvalidArgument("command contains a NUL byte")
        for key, value in env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise InvalidArgument(f"invalid environment variable name or value: {key!r}")
        if cwd and not cwd.startswith("/"):
            raise InvalidArgument(f"cwd must be an absolute path inside the sandbox, got {cwd!r}")
        timeout_s = timeout_ms / 1000 if timeout_ms else exec_config.default_timeout_s
        if timeout_s > exec_config.max_timeout_s:
            raise InvalidArgument(
                f"timeout {timeout_s:g}s is over this daemon's maximum of {exec_config.max_timeout_s:g}s"
            )
        limit = output_limit_bytes or exec_config.default_output_limit_bytes
        if limit > exec_config.max_output_limit_bytes:
            raise InvalidArgument(
                f"output limit {limit} is over this daemon's maximum of {exec_config.max_output_limit_bytes} bytes"
            )
        return cls(argv, shell, stdin, dict(env), cwd, timeout_s, limit)


def sandbox_environment(workdir: str, sandbox_env: dict[str, str], command_env: dict[str, str]) -> dict[str, str]:
    """The environment a command sees: sane defaults, then the sandbox's, then the command's."""
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": workdir,
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
    }
    env.update(sandbox_env)
    env.update(command_env)
    return env
