"""The local backend without root: a daemon run by an ordinary user makes its sandboxes with an
unprivileged user namespace (docs/local-backend.md, "Without root").

The user namespace maps one id, root inside, to the daemon's own uid and gid, for every sandbox
(no other ids are the user's to map). A short step of the daemon's interpreter (ROOT_SETUP)
makes it together with a mount namespace, builds the sandbox's root there (the kernel's
unprivileged overlayfs, Linux 5.11 and later, over the image; where the kernel refuses one, a
copy of a directory image the daemon made beforehand) and execs bubblewrap, which, as root of
that user namespace, makes the pid, ipc, uts and net namespaces as it does for a root daemon,
binds the root at / and starts the sandbox's init. Commands enter with nsenter, user namespace
included, as the daemon's own uid (the namespace's owner may). Cgroups only where the user was
delegated some, rlimits for the limits they do not hold (rlimits.py). The disk cap: a size-capped
tmpfs the setup step mounts over the sandbox's directory in that mount namespace (an ordinary user
may, in a user namespace of its own), holding the overlay's writable layer, the workspace and
/tmp, for caps up to local.rootless_tmpfs_max_bytes; past that, or without an overlay, the
daemon watches the sandbox's writable directories instead (diskwatch.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..root import RootMount
from ..unprivileged import copy_image_tree

# How the writable root is made, as the backend's status names it.
OVERLAY = "overlay"
COPY = "copy"

# Runs as the daemon's user, single-threaded, before bubblewrap: a user namespace mapping root to
# the daemon's ids and a mount namespace of its own, the root built from the layout (argv[1],
# JSON), the sandbox's rlimits set (rlimits.py; after the user namespace is made, so that the
# kernel counts RLIMIT_NPROC in it), then argv[2:] exec'd (bubblewrap, as root of the new user
# namespace; SIGXFSZ stays ignored, as Python leaves it, across the exec). Every path reaches
# the overlay's options as /proc/self/fd/N, so commas or colons in them cannot change the options.
# With spec["disk"] it first mounts a size-capped tmpfs over the sandbox's directory (there, not
# on the host: the daemon reaches it through /proc/<launcher>/root) and makes the directories the
# root, the workspace and /tmp need in it, copying a fork point's into them ("seed"). With --probe
# it only tries an overlay in a scratch directory, then one whose writable layer is on a capped
# tmpfs, and says which work.
ROOT_SETUP = r"""
import ctypes, json, os, resource, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER = 0x20000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1

def fail(what, path=""):
    err = ctypes.get_errno()
    sys.exit(f"{what} {path}: {os.strerror(err)}")

def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src.encode() if src else None, os.fsencode(dst), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None):
        fail(f"mount {fstype or 'bind'}", dst)

def enter_namespaces():
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS):
        fail("unshare (user and mount namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)
    mount(None, "/", None, MS_REC | MS_PRIVATE)

def overlay(src, dst, upper, work):
    os.makedirs(upper, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in (src, upper, work)]
    lower, up, wk = (f"/proc/self/fd/{fd}" for fd in fds)
    try:
        mount("corral-root", dst, "overlay", MS_NOSUID | MS_NODEV, f"lowerdir={lower},upperdir={up},workdir={wk},userxattr")
    finally:
        for fd in fds:
            os.close(fd)

def bind_read_only(src, dst):
    mount(src, dst, None, MS_BIND | MS_REC)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)

def build(spec):
    root, layers = spec["root"], spec["layers"]
    for n, (kind, src, dst) in enumerate(spec["mounts"]):
        target = root + dst if dst != "/" else root
        if kind == "overlay":
            os.makedirs(target, exist_ok=True)
            overlay(src, target, f"{layers}/upper/{n}", f"{layers}/work/{n}")
        elif kind == "link":
            if not os.path.islink(target):
                os.symlink(src, target)
        elif kind == "dir":
            os.makedirs(target, mode=0o755, exist_ok=True)
        elif kind == "bind-writable":
            mount(src, target, None, MS_BIND | MS_REC)
        elif kind == "bind":
            os.makedirs(target, exist_ok=True)
            bind_read_only(src, target)
        elif kind == "hide":
            mount("corral-hidden", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=4k")
    for path in spec["mountpoints"]:
        os.makedirs(root + path, exist_ok=True)

def capped_disk(sandbox, size, seed):
    mount("corral-disk", sandbox, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0711")
    for sub, mode in (("workspace", 0o755), ("tmp", 0o1777), ("root", 0o755), ("layers", 0o700)):
        os.mkdir(f"{sandbox}/{sub}")
        os.chmod(f"{sandbox}/{sub}", mode)
    if seed:
        import subprocess
        done = subprocess.run(["cp", "-a", "--", f"{seed}/.", sandbox], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"cannot copy the fork point: {done.stderr.strip()}")

def set_rlimits(values):
    for name, value in values.items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name.upper()), (value, value))

if sys.argv[1] == "--probe":
    enter_namespaces()
    scratch = sys.argv[2]
    for d in ("lower", "upper", "work", "merged"):
        os.mkdir(f"{scratch}/{d}")
    overlay(f"{scratch}/lower", f"{scratch}/merged", f"{scratch}/upper", f"{scratch}/work")
    print("overlay", flush=True)
    os.mkdir(f"{scratch}/capped")
    capped_disk(f"{scratch}/capped", 1 << 24, "")
    overlay(f"{scratch}/lower", f"{scratch}/capped/root", f"{scratch}/capped/layers/upper", f"{scratch}/capped/layers/work")
    os.mkdir(f"{scratch}/capped/root/made")
    print("tmpfs")
    sys.exit(0)
# Dies with the daemon (bubblewrap's --die-with-parent takes over after the exec).
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() == 1:
    sys.exit("the daemon is gone")
enter_namespaces()
spec = json.loads(sys.argv[1])
if spec["disk"]:
    capped_disk(spec["disk"]["dir"], spec["disk"]["bytes"], spec["disk"]["seed"])
build(spec)
set_rlimits(spec["rlimits"])
os.execv(sys.argv[2], sys.argv[2:])
"""


def setup_argv(
    python: str,
    root: Path,
    layers: Path,
    layout: Sequence[RootMount],
    mountpoints: Sequence[str],
    rlimits: Mapping[str, int] | None = None,
    disk: TmpfsDisk | None = None,
) -> list[str]:
    """The command prefix that builds the root in fresh user and mount namespaces, sets `rlimits`
    (by prlimit's names: as, nproc, fsize) and execs what follows it. `layout` holds the root's
    mounts (overlay, link, dir, bind, hide; masks are left out: root inside is the daemon's own
    uid, and reads no more of the host than it could). `disk`: the capped tmpfs the sandbox's
    directory (the parent of `root` and `layers`) gets first, where it has one."""
    spec = {
        "disk": {"dir": str(root.parent), "bytes": disk.size_bytes, "seed": disk.seed} if disk else None,
        "root": str(root),
        "layers": str(layers),
        "mounts": [(m.kind, m.src, m.dst) for m in layout if m.kind != "mask"],
        "mountpoints": list(mountpoints),
        "rlimits": dict(rlimits or {}),
    }
    return [python, "-I", "-S", "-c", ROOT_SETUP, json.dumps(spec)]


@dataclass(frozen=True)
class TmpfsDisk:
    """A sandbox's capped tmpfs: its size, and the fork point whose copy it starts with ("": none)."""

    size_bytes: int
    seed: str = ""


@dataclass(frozen=True)
class Writable:
    """How this node gives rootless sandboxes a writable root (OVERLAY or COPY, and why not an
    overlay), and whether their writable space can be a capped tmpfs (why not, where not)."""

    root_kind: str
    why_not_overlay: str = ""
    why_not_tmpfs: str = ""


def writable_root_kind(python: str = sys.executable) -> Writable:
    """Whether this kernel lets the daemon's user mount an overlayfs in a user namespace of its
    own (Linux 5.11 and later, unless a distribution turned it off), and one whose writable layer
    is on a size-capped tmpfs (user.* extended attributes on tmpfs, which overlayfs's userxattr
    needs: Linux 6.6 and later). Tried, not guessed from the version."""
    with tempfile.TemporaryDirectory(prefix="corral-rootless-probe-") as scratch:
        try:
            done = subprocess.run(
                [python, "-I", "-S", "-c", ROOT_SETUP, "--probe", scratch],
                capture_output=True,
                text=True,
                timeout=10,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError) as err:
            return Writable(COPY, str(err), "no overlay")
        said = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        if done.stdout.split() == [OVERLAY, "tmpfs"] and done.returncode == 0:
            return Writable(OVERLAY)
        if done.stdout.split()[:1] == [OVERLAY]:
            return Writable(OVERLAY, why_not_tmpfs=f"no overlay over a capped tmpfs: {said}")
        return Writable(COPY, said, "no overlay")


def copy_layout(layout: Sequence[RootMount], copy_dir: Path) -> list[RootMount]:
    """The layout without overlays, for a kernel that refuses unprivileged ones: a directory image
    is copied once into `copy_dir` (hard links and holes kept, reflinks where the filesystem
    has them), which becomes the root; the "host" image's system directories are shown read-only
    (copying the host's /usr per sandbox would cost gigabytes)."""
    copied: list[RootMount] = []
    for mount in layout:
        if mount.kind != "overlay":
            copied.append(mount)
        elif mount.dst == "/":
            copy_image_tree(mount.src, copy_dir, "the sandbox's root")
            copied.append(RootMount("bind-writable", str(copy_dir), "/"))
        else:
            copied.append(RootMount("bind", mount.src, mount.dst))
    return copied
