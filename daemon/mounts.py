"""Host bind mounts a caller asks for on CreateSandbox, checked before any sandbox exists.

The daemon runs as root and the caller may not be, so a bind mount is a way to read (or write)
host files with the daemon's rights. Only paths under the roots the node's configuration names
(sandbox.bind_roots) are allowed, judged after symlinks are resolved, and a path outside them is
refused before the daemon so much as looks at it: the answer never tells a caller whether a host
path outside the roots exists. The daemon's own socket, state and run directories are refused even
under a root.

What passes is a tuple of `BindMount` with the host path resolved, ordered by sandbox path, so that
a mount inside another comes after it: what every backend receives in `SandboxSpec.mounts`. (A
host path could still be swapped for a symlink by a host user who can write under a root between
this check and the backend's bind: roots should be directories only trusted users write to.)
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from corral.sdk.errors import InvalidArgument, NotFound, PermissionDenied

from .backends.base import RUN_DIR_IN_SANDBOX, BindMount
from .rules import no_nul

MAX_MOUNTS = 32
# Inside paths the daemon or the kernel own in every sandbox: no mount may cover, sit inside, or
# hide them (the sandbox's workdir is added per sandbox).
RESERVED_SANDBOX_PATHS = ("/proc", "/dev", "/sys", RUN_DIR_IN_SANDBOX)


@dataclass(frozen=True)
class MountRequest:
    """A bind mount as the caller sent it."""

    host_path: str
    sandbox_path: str
    writable: bool = False


def _within(path: str, root: str) -> bool:
    """`path` is `root` or lies under it (both absolute and normalised)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _overlaps(a: str, b: str) -> bool:
    """One of the two paths is the other or lies under it."""
    return _within(a, b) or _within(b, a)


def _normal(path: str) -> str:
    """An absolute path without '.', '..', repeated or trailing slashes (lexically)."""
    return "/" + posixpath.normpath(path).lstrip("/")


def sandbox_path(path: str, workdir: str) -> str:
    """Where a mount appears inside the sandbox, normalised; INVALID_ARGUMENT for a relative path,
    "/" or one that covers, lies in or hides a reserved path (RESERVED_SANDBOX_PATHS, the workdir)."""
    no_nul("mount sandbox_path", path)
    if not path.startswith("/"):
        raise InvalidArgument(f"a mount's sandbox_path must be absolute, got {path!r}")
    normal = _normal(path)
    if normal == "/":
        raise InvalidArgument("a mount cannot cover the sandbox's root (sandbox_path '/')")
    for reserved in (*RESERVED_SANDBOX_PATHS, _normal(workdir)):
        if _overlaps(normal, reserved):
            raise InvalidArgument(
                f"a mount's sandbox_path cannot be, lie in or contain {reserved} (reserved inside every sandbox); "
                f"got {path!r}"
            )
    return normal


def _resolved_roots(roots: Iterable[str]) -> list[str]:
    return [os.path.realpath(root) for root in roots]


def host_path(path: str, roots: Sequence[str], protected: Sequence[str]) -> str:
    """The host path resolved (symlinks followed), when it lies under one of `roots` and clear of
    the `protected` paths; PERMISSION_DENIED otherwise, decided before anything about the path
    itself is looked at. Then NOT_FOUND when it does not exist, INVALID_ARGUMENT when it is neither
    a directory nor a regular file."""
    no_nul("mount host_path", path)
    if not path.startswith("/"):
        raise InvalidArgument(f"a mount's host_path must be absolute, got {path!r}")
    if not roots:
        raise PermissionDenied("this node allows no bind mounts (its sandbox.bind_roots is empty)")
    allowed = f"this node allows bind mounts only under {', '.join(roots)} (sandbox.bind_roots)"
    resolved_roots = _resolved_roots(roots)
    # Lexically first: a path that does not even name a place under a root is refused without a
    # single system call on it (realpath would stat its components).
    normal = _normal(path)
    if not any(_within(normal, root) for root in (*map(_normal, roots), *resolved_roots)):
        raise PermissionDenied(f"{allowed}; {path!r} is not under them")
    resolved = os.path.realpath(normal)
    if not any(_within(resolved, root) for root in resolved_roots):
        raise PermissionDenied(f"{allowed}; {path!r} leads outside them (through a symlink)")
    for own in _resolved_roots(protected):
        if _overlaps(resolved, own):
            raise PermissionDenied(f"{path!r} is or holds the daemon's own files ({own}): it cannot be mounted")
    try:
        mode = os.stat(resolved).st_mode
    except FileNotFoundError:
        raise NotFound(f"mount host_path {path!r} does not exist") from None
    except OSError as err:
        raise InvalidArgument(f"mount host_path {path!r} cannot be used: {err.strerror}") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise InvalidArgument(f"mount host_path {path!r} must be a directory or a regular file")
    return resolved


def bind_mounts(
    requests: Sequence[MountRequest], *, roots: Sequence[str], protected: Sequence[str], workdir: str
) -> tuple[BindMount, ...]:
    """The checked mounts of a new sandbox, ordered by sandbox path (see the module docstring).
    Everything about the sandbox side and the count is checked before any host path is looked at."""
    if len(requests) > MAX_MOUNTS:
        raise InvalidArgument(f"a sandbox takes at most {MAX_MOUNTS} mounts, got {len(requests)}")
    targets = [sandbox_path(request.sandbox_path, workdir) for request in requests]
    seen: set[str] = set()
    for target in targets:
        if target in seen:
            raise InvalidArgument(f"two mounts have the same sandbox_path {target!r}")
        seen.add(target)
    mounts = [
        BindMount(host_path(request.host_path, roots, protected), target, read_only=not request.writable)
        for request, target in zip(requests, targets, strict=True)
    ]
    return tuple(sorted(mounts, key=lambda mount: mount.sandbox_path.split("/")))
