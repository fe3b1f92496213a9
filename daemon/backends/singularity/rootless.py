"""The Apptainer backend without root: a daemon run by an ordinary user runs its sandboxes in
Apptainer's own unprivileged mode (docs/backends.md, "Apptainer / Singularity", "Without root").

`apptainer exec --fakeroot` as the daemon's user makes the sandbox's user namespace: root inside
is the daemon's uid, and where /etc/subuid and /etc/subgid grant the user a range (with newuidmap
and newgidmap) Apptainer maps ids 1 .. 65535 to that range, else only root exists inside (its
"root-mapped namespace"). Its image is a copy the daemon's user owns (ImageCopies: a SIF file's
root partition unpacked with unsquashfs, since /dev/fuse is root's where FUSE would let Apptainer
mount it, or a directory copied), made once per image and shared read-only by every sandbox,
so that root inside owns the image's files as root does in an image; the writable layer is
`--overlay` on a directory of the sandbox's own (the kernel's overlayfs in Apptainer's user
namespace), which lasts the sandbox's life, lies on disk rather than in memory, and is what
ForkSandbox copies. `--net --network none` works unprivileged (a network namespace with only
`lo`, owned by the sandbox's user namespace). The init reads the stdin the daemon holds, as in
root mode. Commands enter with nsenter, user namespace included, as the daemon's own uid (the
namespace's owner may), under the seccomp filter.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from corral.sdk.errors import FailedPrecondition

from ...seccomp import loader_argv, supported
from ..base import RUN_DIR_IN_SANDBOX
from ..nsenter import nsenter_argv
from ..unprivileged import copy_image_tree, remove_tree
from .sif_mount import squashfs_partition

# unsquashfs's complaint about the device nodes a SIF's /dev may hold, which only root may make
# (the sandbox gets a /dev of Apptainer's).
NOT_SUPERUSER = "because you're not superuser"


def subordinate_ids(user: pwd.struct_passwd) -> str:
    """ "" when /etc/subuid and /etc/subgid both grant `user` a range and newuidmap and newgidmap
    exist (Apptainer's --fakeroot then maps a range of ids), else what is missing."""
    missing = [tool for tool in ("newuidmap", "newgidmap") if shutil.which(tool) is None]
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            lines = []
        if not any(line.split(":")[0] in (user.pw_name, str(user.pw_uid)) for line in lines):
            missing.append(f"no range for {user.pw_name} in {path}")
    return ", ".join(missing)


def fakeroot_detail(why_no_range: str) -> str:
    """What ids a rootless sandbox has, as the backend's status says it."""
    if not why_no_range:
        return "root inside is the daemon's uid, ids 1-65535 its subordinate range (apptainer --fakeroot)"
    return (
        "root inside is the daemon's uid and no other id exists (apptainer --fakeroot, root-mapped "
        f"namespace: {why_no_range})"
    )


class ImageCopies:
    """Copies of images the daemon's user owns, one per image (its path, size and time of change),
    kept under `base` for every sandbox of the image to use read-only beneath its overlay."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, image: str) -> Path:
        """The copy of `image` (a SIF file or a directory), made on first use."""
        st = os.stat(image)
        if os.path.isdir(image) and st.st_uid == os.getuid():
            return Path(image)  # already the user's own
        key = hashlib.sha256(f"{os.path.realpath(image)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
        copy = self.base / key
        async with self._locks.setdefault(key, asyncio.Lock()):
            if not copy.is_dir():
                await asyncio.to_thread(self._make, image, copy)
        return copy

    def _make(self, image: str, copy: Path) -> None:
        self.base.mkdir(parents=True, mode=0o700, exist_ok=True)
        partial = copy.with_name(copy.name + ".partial")
        remove_tree(partial)
        try:
            if os.path.isdir(image):
                copy_image_tree(image, partial, "a sandbox of the daemon's user")
            else:
                unpack_sif(image, partial)
        except BaseException:
            remove_tree(partial)
            raise
        partial.rename(copy)


def unpack_sif(path: str, dest: Path) -> None:
    """Unpacks a SIF file's root partition (squashfs) into `dest` as the daemon's user, device
    nodes left out. FAILED_PRECONDITION when unsquashfs is missing or fails otherwise."""
    offset, _ = squashfs_partition(path)
    if shutil.which("unsquashfs") is None:
        raise FailedPrecondition(
            "unsquashfs is not installed (apt-get install squashfs-tools): a daemon without root needs it for SIF files"
        )
    done = subprocess.run(
        ["unsquashfs", "-q", "-n", "-o", str(offset), "-d", str(dest), path], capture_output=True, text=True
    )
    failures = [line for line in done.stderr.splitlines() if line.strip() and NOT_SUPERUSER not in line]
    if done.returncode != 0 and (failures or not dest.is_dir()):
        raise FailedPrecondition(
            f"cannot unpack SIF file {path}: {' '.join(failures)[-500:] or f'exit {done.returncode}'}"
        )


def rootless_argv(
    binary: str,
    image: Path,
    *,
    overlay: Path,
    workspace: Path,
    workdir: str,
    run_dir: Path,
    mounts: Sequence,
    network: bool,
    init_script: str,
) -> list[str]:
    """`apptainer exec` of the sandbox's init in Apptainer's unprivileged mode (module docstring)."""
    argv = [
        binary,
        # (Its INFO lines, on the init's stdout, would come before the init's ready line.)
        "--quiet",
        "exec",
        "--fakeroot",
        # Apptainer would otherwise run the init under the fakeroot(1) program where installed:
        # an LD_PRELOAD the processes corral enters would not share.
        "--ignore-fakeroot-command",
        "--containall",
        "--no-home",
        "--no-init",
        "--hostname",
        "corral",
        "--overlay",
        str(overlay),
        "--bind",
        f"{workspace}:{workdir}",
        "--bind",
        f"{run_dir}:{RUN_DIR_IN_SANDBOX}",
        "--pwd",
        workdir,
        "--no-mount",
        "bind-paths",
    ]
    for mount in mounts:
        argv += ["--bind", f"{mount.host_path}:{mount.sandbox_path}:{'ro' if mount.read_only else 'rw'}"]
    if not network:
        argv += ["--net", "--network", "none"]
    return [*argv, str(image), "/bin/sh", "-c", init_script]


def enter_argv(
    init_pid: int, workdir: str, argv: Sequence[str], cwd: str, env: Mapping[str, str], *, network: bool
) -> list[str]:
    """The host command that runs argv in the sandbox of `init_pid` as root inside: nsenter into its
    namespaces, its user namespace included, keeping the daemon's own uid (root there), under the
    seccomp filter. A sandbox with `network` is on the host's network namespace, which is not
    joined (an unprivileged daemon may not)."""
    enter = nsenter_argv(
        shutil.which("nsenter") or "nsenter",
        init_pid,
        0,
        workdir,
        argv,
        cwd,
        env,
        user_namespace=f"/proc/{init_pid}/ns/user",
        preserve_credentials=True,
        net=not network,
    )
    return [*seccomp_prefix(), *enter]


def seccomp_prefix() -> list[str]:
    """The prefix that puts entered processes under daemon/seccomp.py's filter (none where it does
    not exist for this machine's architecture)."""
    return [] if supported() else loader_argv(sys.executable, entering=True)
