"""How the local backend lays out a sandbox's root and starts its init: bubblewrap, or util-linux
`unshare` + mount + chroot where bubblewrap is missing. The daemon builds the root itself
(root.py, from `root_layout`); both launchers bind it at / and add the same private mounts,
so the two cannot drift in what a sandbox sees."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ...seccomp import LOAD_FUNCTION
from ..base import RUN_DIR_IN_SANDBOX, BindMount
from ..root import INIT_READY, RootMount

# What a sandbox on the "host" image sees of the host's root: the operating system, no data
# (/home, /root, /srv, /opt, /var, /mnt... stay out unless listed in local.host_paths).
HOST_OS_ENTRIES = ("bin", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "usr")
# Directories the launchers mount over every sandbox's root (tmpfs or the sandbox's own).
OWN_MOUNTS = ("/tmp", "/run")
# bubblewrap's init: keeps the namespaces alive until its stdin (held by the daemon) closes. It
# runs as root without capabilities, so the sandbox's uid can neither kill nor stop it.
INIT_SCRIPT = "printf 'corral-init-ready\\n'; read -r _"


def root_layout(
    rootfs: str, hidden_paths: Sequence[str], host_paths: Sequence[str] = (), secrets: Sequence[str] = ()
) -> list[RootMount]:
    """How root.build_root makes a sandbox's root. A root filesystem directory: one writable
    overlay of it. The host ("/"): a writable overlay of each operating-system directory, the
    directories of `host_paths` (absolute, symlinks resolved) read-only at their own paths, the
    daemon's own paths covered wherever they fall inside what is shown, and `secrets` (host files
    other users may not read, root.secrets) masked, and an empty /root."""
    if rootfs != "/":
        return [RootMount("overlay", rootfs, "/")]
    layout = []
    for entry in HOST_OS_ENTRIES:
        path = os.path.join(rootfs, entry)
        if os.path.islink(path):
            layout.append(RootMount("link", os.readlink(path), f"/{entry}"))
        elif os.path.isdir(path):
            layout.append(RootMount("overlay", path, f"/{entry}"))
    shown = [m.dst for m in layout if m.kind == "overlay"]
    # Root's home, empty and its own (HOME for root: SandboxRuntime.home); the host's stays out.
    layout.append(RootMount("dir", "", "/root"))
    made = {"/root"}
    for path in sorted(host_paths):  # parents first: a path inside one already shown is skipped
        if os.path.isdir(path) and not _inside(path, shown) and not _inside(path, OWN_MOUNTS):
            parents = [p for p in _ancestors(path) if p not in made]
            layout += [RootMount("dir", "", p) for p in parents]
            made.update(parents)
            layout.append(RootMount("bind", path, path))
            shown.append(path)
    for hidden in hidden_paths:
        if os.path.isdir(hidden) and _inside(hidden, shown):
            layout.append(RootMount("hide", "", hidden))
    layout += [RootMount("mask", "", path) for path in secrets if _inside(path, shown)]
    return layout


def host_paths_over_own_mounts(host_paths: Sequence[str], hidden_paths: Sequence[str]) -> list[BindMount]:
    """The `host_paths` that lie under a directory every sandbox gets of its own (/tmp, /run):
    the launcher mounts those over the root, so they are bound read-only after it, like
    CreateSandbox's mounts, instead of in the root where they would be covered. Such a bind
    cannot hide what lies inside it, so one that holds a path of the daemon's own
    (`hidden_paths`: its state, its socket) is not shown at all."""
    return [
        BindMount(path, path, read_only=True)
        for path in sorted(host_paths)
        if os.path.isdir(path)
        and _inside(path, OWN_MOUNTS)
        and not any(_inside(hidden, [path]) for hidden in hidden_paths)
    ]


def _ancestors(path: str) -> list[str]:
    """/a/b/c -> [/a, /a/b]: the directories a bind at `path` needs on the sandbox's root."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _inside(path: str, parents: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def bwrap_argv(
    bwrap: str,
    root: Path,
    sandbox_dir: Path,
    run_dir: Path,
    workdir: str,
    network: bool,
    shm_bytes: int,
    mounts: Sequence[BindMount] = (),
) -> list[str]:
    argv = [
        bwrap,
        # bwrap's pid 1 waits for every process of the sandbox, not just for init: without this,
        # background processes would outlive a daemon killed with SIGKILL. With it the kernel
        # kills bwrap (and so the whole pid namespace) when the daemon's thread that started it
        # dies.
        "--die-with-parent",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "corral",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    if not network:
        argv.append("--unshare-net")
    return argv + [
        # The root the daemon built (recursively, nosuid and nodev like every bwrap bind).
        "--bind",
        str(root),
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        # --dev's /dev/shm is root's; POSIX shared memory and semaphores (multiprocessing) need
        # a writable one.
        "--perms",
        "1777",
        "--size",
        str(shm_bytes),
        "--tmpfs",
        "/dev/shm",
        "--tmpfs",
        "/run",
        "--bind",
        str(sandbox_dir / "tmp"),
        "/tmp",
        "--bind",
        str(sandbox_dir / "workspace"),
        workdir,
        "--bind",
        str(run_dir),
        RUN_DIR_IN_SANDBOX,
        *host_binds(mounts),
        "--chdir",
        workdir,
        "--",
        "/bin/sh",
        "-c",
        INIT_SCRIPT,
    ]


def host_binds(mounts: Sequence[BindMount]) -> list[str]:
    """bubblewrap's options for CreateSandbox's host bind mounts (checked by the daemon, parents
    first); bwrap makes their mount points in the sandbox's writable root."""
    argv: list[str] = []
    for mount in mounts:
        argv += ["--ro-bind" if mount.read_only else "--bind", mount.host_path, mount.sandbox_path]
    return argv


def bwrap_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits a bwrap command line into its options and the rest ([bwrap, "--", program...])."""
    end = argv.index("--")
    return argv[1:end], [argv[0], *argv[end:]]


# Runs as root, pid 1 of fresh mount/pid/ipc/uts(/net) namespaces: binds the root the daemon
# built at $R, adds the same private mounts as bubblewrap, then becomes the sandbox's init
# (_UNSHARE_INIT). Every path comes as its own argument (never parsed out of another program's
# output), so spaces and odd bytes in host paths cannot break the mount steps.
_UNSHARE_SETUP = r"""
set -eu
ROOT=$1 R=$2 SANDBOX=$3 RUNDIR=$4 WORKDIR=$5 SHM_BYTES=$6 PY=$7 INIT_CODE=$8
mount --rbind "$ROOT" "$R"
# hidepid: the sandbox's users see their own processes only, not the root-owned pid 1.
mount -t proc -o nosuid,nodev,noexec,hidepid=invisible proc "$R/proc" 2>/dev/null ||
  mount -t proc -o nosuid,nodev,noexec,hidepid=2 proc "$R/proc"
mount -t tmpfs -o mode=0755,nosuid dev "$R/dev"
for d in null zero full random urandom tty; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
mkdir "$R/dev/shm" "$R/dev/pts"
mount -t tmpfs -o "mode=1777,nosuid,nodev,size=$SHM_BYTES" shm "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"; ln -s fd/0 "$R/dev/stdin"; ln -s fd/1 "$R/dev/stdout"; ln -s fd/2 "$R/dev/stderr"
mount -t tmpfs -o mode=0755,nosuid,nodev run "$R/run"
mount --bind "$SANDBOX/tmp" "$R/tmp"
mount --bind "$SANDBOX/workspace" "$R$WORKDIR"
mkdir -p "$R/run/corral" && mount --bind "$RUNDIR" "$R/run/corral"
shift 8
# CreateSandbox's host bind mounts, parents first: "ro|rw" host path, sandbox path. Not recursive
# (what is mounted below the host path stays out); the init makes them nosuid and nodev too.
while [ $# -ge 3 ]; do
  mode=$1 src=$2 dst=$3; shift 3
  if [ -d "$src" ]; then mkdir -p "$R$dst"; else mkdir -p "$(dirname "$R$dst")"; touch "$R$dst"; fi
  mount --bind "$src" "$R$dst"
  if [ "$mode" = ro ]; then mount -o remount,bind,ro "$R$dst"; fi
done
echo corral > /proc/sys/kernel/hostname
# A fresh network namespace starts with loopback down (bubblewrap brings it up itself).
if command -v ip >/dev/null; then ip link set lo up 2>/dev/null || true; fi
cd "$R"
exec "$PY" -I -S -c "$INIT_CODE" "$R" "$WORKDIR"
"""

# The sandbox's init under unshare, run by the daemon's own interpreter as pid 1 (outside the
# chroot until it enters it). It makes every mount of the root nosuid and nodev (but the device
# nodes of /dev), recursively, with mount_setattr (Linux 5.12), which adds flags without clearing
# others (the read-only ones stay so);
# then chroots into the root, drops every capability and, as root, holds the namespaces: the
# sandbox's uid can neither kill nor stop it, and the kernel ignores SIGKILL sent to a pid
# namespace's init from inside. It reaps orphans (a shell would not, and zombies count against
# pids.max) and exits when its stdin, held by the daemon, closes: the daemon is gone, and with
# pid 1 the kernel kills every process of the sandbox. It loads the sandbox's seccomp filter last
# (SECCOMP: its program in hex, "" for none).
_UNSHARE_INIT = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)

class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]

NOSUID, NODEV, AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = 0x2, 0x4, -100, 0x8000, 442
root, workdir = sys.argv[1:]
# Everything nosuid and nodev, but the device nodes bound into /dev (its tmpfs is root's).
for path, add, clear in ((root, NOSUID | NODEV, 0), (root + "/dev", 0, NODEV), (root + "/dev/shm", NODEV, 0)):
    attr = MountAttr(add, clear, 0, 0)
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, os.fsencode(path), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)):
        sys.exit(f"cannot restrict the mounts of {path}: {os.strerror(ctypes.get_errno())} (mount_setattr needs Linux 5.12)")
os.chroot(root)
os.chdir(workdir)

class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

no_caps = (ctypes.c_uint32 * 6)()
if libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), no_caps):
    sys.exit(f"cannot drop capabilities: {os.strerror(ctypes.get_errno())}")
if SECCOMP:
    load_seccomp(bytes.fromhex(SECCOMP))

def reap(signum, frame):
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return

signal.signal(signal.SIGCHLD, reap)
os.write(1, READY)
while os.read(0, 4096):
    pass
""".replace("READY", repr(INIT_READY))


def unshare_argv(
    unshare: str,
    root: Path,
    sandbox_dir: Path,
    run_dir: Path,
    workdir: str,
    network: bool,
    shm_bytes: int,
    mounts: Sequence[BindMount] = (),
    seccomp: bytes = b"",
) -> list[str]:
    """`seccomp`: the program of the sandbox's seccomp filter (none when empty)."""
    (sandbox_dir / "mnt").mkdir(exist_ok=True)
    argv = [unshare, "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--propagation", "private"]
    if not network:
        argv.append("--net")
    argv += [
        "--",
        "/bin/sh",
        "-c",
        _UNSHARE_SETUP,
        "corral-setup",
        str(root),
        str(sandbox_dir / "mnt"),
        str(sandbox_dir),
        str(run_dir),
        workdir,
        str(shm_bytes),
        sys.executable,
        f"SECCOMP = {seccomp.hex()!r}\n{LOAD_FUNCTION}{_UNSHARE_INIT}",
    ]
    for mount in mounts:
        argv += ["ro" if mount.read_only else "rw", mount.host_path, mount.sandbox_path]
    return argv


def init_pid(launcher_pid: int) -> int:
    """The host pid of the process whose namespaces and root commands enter: the launcher's child,
    the sandbox's pid 1 (bwrap's own init, or _UNSHARE_INIT)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    if not children:
        raise RuntimeError(f"process {launcher_pid} of the sandbox launcher has no child")
    return int(children[0])
