"""Entering a live sandbox's namespaces from the host with util-linux nsenter.

Used by every backend whose sandboxes are namespaces of a process on this host (bubblewrap and
unshare sandboxes, Docker containers, Apptainer instances): a few milliseconds, against ~100 ms
for `docker exec`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

# The environment of the host-side steps that enter a sandbox (a cgroup-join shell, nsenter or
# setpriv), which run as root on the host: never the caller's, so that LD_PRELOAD, GCONV_PATH and
# the like cannot reach a root process. The caller's environment is set inside (`inside_env`).
HOST_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def inside_env(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """argv started with exactly `env`, by the sandbox's own `env` program as the sandbox user."""
    return ["env", "-i", *(f"{key}={value}" for key, value in env.items()), *argv]


def nsenter_argv(
    nsenter: str,
    target_pid: int,
    uid: int,
    workdir: str,
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    *,
    gid: int | None = None,
    user_namespace: str = "",
    preserve_credentials: bool = False,
    net: bool = True,
) -> list[str]:
    """Runs argv as `uid` (and `gid`, default: the uid) in the mount, pid, ipc, uts and net
    namespaces and the root of `target_pid`, starting in `cwd` (default: the target's own cwd,
    which is `workdir`), with environment `env`. `user_namespace`: a path to a user namespace to
    join last, whose ids uid and gid then are; with `preserve_credentials`, the caller's own ids
    are kept instead (a daemon without root entering the user namespace it owns, where its uid is
    already the one it maps: it may not change ids). `net=False` leaves the net namespace alone:
    a sandbox on the host's network, whose namespace an unprivileged daemon may not join (nor
    need to). Spawn it with HOST_ENV."""
    enter = [nsenter, "-t", str(target_pid), "-m", "-p", "-i", "-u", *(["-n"] if net else []), "-r", "-w"]
    if user_namespace:
        # nsenter joins a user namespace after the others when that drops privileges.
        enter.append(f"--user={user_namespace}")
    if preserve_credentials:
        enter += ["--preserve-credentials", "--"]
    else:
        enter += ["-S", str(uid), "-G", str(uid if gid is None else gid), "--"]
    if cwd and os.path.normpath(cwd) != workdir:
        # nsenter can only take the target's cwd; change directory once inside.
        enter += ["/bin/sh", "-c", 'cd -- "$1" || exit 126; shift; exec "$@"', "sh", cwd]
    return [*enter, *inside_env(argv, env)]
