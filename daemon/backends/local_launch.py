"""How the local backend builds a sandbox's root and starts its init: bubblewrap, or util-linux
`unshare` + mount + chroot where bubblewrap is missing. Both follow one layout (`root_layout`), so
the two cannot drift in what a sandbox sees."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .base import RUN_DIR_IN_SANDBOX

SKIPPED_TOP_LEVEL = {"proc", "dev", "sys", "tmp", "run", "lost+found"}
INIT_READY = b"corral-init-ready\n"
# Init keeps the namespaces alive until its stdin (held by the daemon) closes.
INIT_SCRIPT = "printf 'corral-init-ready\\n'; read -r _"


@dataclass(frozen=True)
class Mount:
    kind: str  # "bind" (read-only), "link" (symlink: src is the target) or "hide" (empty tmpfs)
    src: str
    dst: str


def root_layout(rootfs: str, hidden_paths: list[str]) -> list[Mount]:
    """The read-only part of a sandbox root: the image's top-level entries, minus what must stay
    private, with the daemon's own paths covered when the host itself is the image."""
    layout = []
    for entry in sorted(os.listdir(rootfs)):
        if entry in SKIPPED_TOP_LEVEL:
            continue
        path = os.path.join(rootfs, entry)
        if os.path.islink(path):
            layout.append(Mount("link", os.readlink(path), f"/{entry}"))
        elif os.path.isdir(path):
            layout.append(Mount("bind", path, f"/{entry}"))
    if rootfs == "/":
        for hidden in hidden_paths:
            if os.path.isdir(hidden) and hidden.split("/")[1] not in SKIPPED_TOP_LEVEL:
                layout.append(Mount("hide", "", hidden))
    return layout


def bwrap_argv(
    bwrap: str, layout: list[Mount], sandbox_dir: Path, run_dir: Path, workdir: str, network: bool
) -> list[str]:
    argv = [
        bwrap,
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
    flags = {"bind": "--ro-bind", "link": "--symlink", "hide": "--tmpfs"}
    for m in layout:
        argv += [flags[m.kind], m.src, m.dst] if m.kind != "hide" else ["--tmpfs", m.dst]
    return argv + [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
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
        "--remount-ro",
        "/",
        "--chdir",
        workdir,
        "--",
        "/bin/sh",
        "-c",
        INIT_SCRIPT,
    ]


def bwrap_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits a bwrap command line into its options and the rest ([bwrap, "--", program...])."""
    end = argv.index("--")
    return argv[1:end], [argv[0], *argv[end:]]


# Runs as root, pid 1 of fresh mount/pid/ipc/uts(/net) namespaces: builds the root under $R with
# the same layout as bubblewrap, then chroots into it as the sandbox user to become init.
_UNSHARE_SETUP = r"""
set -eu
R=$1 SANDBOX=$2 RUNDIR=$3 WORKDIR=$4 SANDBOX_UID=$5 REAPER=$6 REAPER_CODE=$7; shift 7
mount -t tmpfs -o mode=0755 corral-root "$R"
while [ $# -gt 0 ]; do
  kind=$1 src=$2 dst=$3; shift 3
  case $kind in
    bind) mkdir -p "$R$dst"; mount --rbind "$src" "$R$dst"
          # remount acts on one mount: do it for every mount the recursive bind brought along
          findmnt -R -rn -o TARGET "$R$dst" | while read -r m; do
            mount -o remount,bind,ro,nosuid,nodev "$m" 2>/dev/null || true
          done ;;
    link) ln -s "$src" "$R$dst" ;;
    hide) mount -t tmpfs -o mode=0755,size=4k corral-hidden "$R$dst" ;;
  esac
done
mkdir -p "$R/proc" "$R/dev" "$R/tmp" "$R/run" "$R$WORKDIR"
# hidepid: the sandbox user sees its own processes only, not the root-owned pid 1, whose command
# line names host paths.
mount -t proc -o nosuid,nodev,noexec,hidepid=invisible proc "$R/proc" 2>/dev/null ||
  mount -t proc -o nosuid,nodev,noexec,hidepid=2 proc "$R/proc"
mount -t tmpfs -o mode=0755,nosuid dev "$R/dev"
for d in null zero full random urandom tty; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
mkdir "$R/dev/shm" "$R/dev/pts"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"; ln -s fd/0 "$R/dev/stdin"; ln -s fd/1 "$R/dev/stdout"; ln -s fd/2 "$R/dev/stderr"
mount -t tmpfs -o mode=0755,nosuid,nodev run "$R/run"
mount --bind "$SANDBOX/tmp" "$R/tmp"
mount --bind "$SANDBOX/workspace" "$R$WORKDIR"
mkdir -p "$R/run/corral" && mount --bind "$RUNDIR" "$R/run/corral"
mount -o remount,ro,nosuid "$R"
echo corral > /proc/sys/kernel/hostname
# A fresh network namespace starts with loopback down (bubblewrap brings it up itself).
if command -v ip >/dev/null; then ip link set lo up 2>/dev/null || true; fi
cd "$R"
exec "$REAPER" -c "$REAPER_CODE" chroot --userspec="$SANDBOX_UID:$SANDBOX_UID" --groups="$SANDBOX_UID" "$R" /bin/sh -c "cd \"$WORKDIR\" && $INIT"
"""

# pid 1 of a pid namespace must reap orphans, or killed processes stay zombies and keep counting
# against pids.max. A shell does not reap children it did not start, so under unshare pid 1 is
# this loop (run by the daemon's own interpreter, outside the chroot); the sandbox's init shell
# is its child.
_REAPER_CODE = (
    "import os, sys\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "while os.wait()[0] != child:\n"
    "    pass\n"
)


def unshare_argv(
    unshare: str, layout: list[Mount], sandbox_dir: Path, run_dir: Path, workdir: str, network: bool, uid: int
) -> list[str]:
    (sandbox_dir / "root").mkdir(exist_ok=True)
    argv = [unshare, "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--propagation", "private"]
    if not network:
        argv.append("--net")
    argv += [
        "--",
        "/bin/sh",
        "-c",
        _UNSHARE_SETUP.replace("$INIT", INIT_SCRIPT.replace('"', '\\"')),
        "corral-setup",
        str(sandbox_dir / "root"),
        str(sandbox_dir),
        str(run_dir),
        workdir,
        str(uid),
        sys.executable,
        _REAPER_CODE,
    ]
    for m in layout:
        argv += [m.kind, m.src or "-", m.dst]
    return argv


def init_pid(launcher_pid: int, depth: int) -> int:
    """The host pid of the process whose namespaces and root commands enter: `depth` generations
    below the launcher (bwrap: its child, the sandbox's pid 1; unshare: pid 1's child)."""
    pid = launcher_pid
    for _ in range(depth):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if not children:
            raise RuntimeError(f"process {pid} of the sandbox launcher has no child")
        pid = int(children[0])
    return pid
