"""What a daemon that is not root needs on every backend that runs sandboxes without privileges
(local/rootless.py, singularity/rootless.py): whether the user may make a user namespace, copies of
images the user owns, the one user such sandboxes have, and removing what they leave.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from corral.sdk.errors import FailedPrecondition

from ..users import SandboxUser


def user_namespace_support(unshare: str | None) -> str:
    """ "" when the daemon's user may make a user namespace mapping root to itself, else why not
    (the kernel's or the distribution's refusal, as `unshare --user --map-root-user` reports it)."""
    if unshare is None:
        return "util-linux unshare is not installed (apt-get install util-linux)"
    try:
        done = subprocess.run(
            [unshare, "--user", "--map-root-user", "true"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"no unprivileged user namespaces ({err})"
    if done.returncode != 0:
        return f"no unprivileged user namespaces ({done.stderr.strip() or f'exit {done.returncode}'})"
    return ""


def copy_image_tree(src: str, dest: Path, purpose: str) -> None:
    """Copies the image directory `src` to `dest` as the daemon's user (hard links and holes kept,
    reflinks where the filesystem has them), so that every file is the user's: root inside, which
    is that user, then owns the image. FAILED_PRECONDITION naming `purpose` when it cannot."""
    copy = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--no-target-directory", src, str(dest)], capture_output=True, text=True
    )
    # What the daemon's user may not read stays out, as an overlay would not show it either,
    # and so do device nodes, which it may not make (the sandbox has a /dev of its own).
    failures = [line for line in copy.stderr.splitlines() if not _copy_may_skip(line)]
    if copy.returncode != 0 and (failures or not dest.is_dir()):
        raise FailedPrecondition(f"cannot copy image {src} for {purpose}: {' '.join(failures) or copy.stderr.strip()}")


def only_root(who: SandboxUser, spec: str, docs: str) -> SandboxUser:
    """`who` (the user a request named as `spec`), refused unless it is root: a daemon without
    root maps no other id into its sandboxes. `docs` names where that is explained."""
    if who.uid != 0 or who.gid != 0:
        raise FailedPrecondition(
            f"user {spec!r} is uid {who.uid}: a daemon without root maps only root (uid 0) into its sandboxes ({docs})"
        )
    return who


def _copy_may_skip(cp_error: str) -> bool:
    return cp_error.endswith("Permission denied") or (
        "cannot create special file" in cp_error and cp_error.endswith("Operation not permitted")
    )


def remove_tree(path: Path) -> None:
    """Removes a directory tree the daemon's user owns, directories without write or search
    permission included (an image's read-only directories copied up by an overlay, overlayfs's
    own mode 000 work directories): root would pass through them, an ordinary user must first
    give itself the permission."""
    if not path.is_dir() or path.is_symlink():
        return
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for parent, dirs, _files in os.walk(path):
        for name in dirs:
            full = os.path.join(parent, name)
            if not os.path.islink(full):
                with contextlib.suppress(OSError):
                    os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)
