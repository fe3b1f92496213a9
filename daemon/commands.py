"""The environment commands, shells and kernels see inside a sandbox."""

from __future__ import annotations

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sandbox_environment(home: str, sandbox_env: dict[str, str], command_env: dict[str, str]) -> dict[str, str]:
    """The environment a command sees: sane defaults, then the sandbox's, then the command's.
    `home` is the home of the user it runs as (SandboxRuntime.home)."""
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": home,
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        # Nobody reads a programmatic terminal page by page: programs that page print instead.
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "MANPAGER": "cat",
        "SYSTEMD_PAGER": "cat",
    }
    env.update(sandbox_env)
    env.update(command_env)
    return env
