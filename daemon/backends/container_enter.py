"""Entering a container (a Docker or Podman container, an Apptainer sandbox) as one of its users,
root included, with what Docker gives a container's root and no more.

Commands, shells and kernels of the container backends run as the image's user by default (root
for most images) or the user a request names. Without a user namespace (Docker, Podman), root
inside is host uid 0, so the step that enters sets, for the program it starts (an Apptainer
sandbox has a user namespace of its own, which the step joins last: there uid 0 is the sandbox's
first host id, and the capabilities below hold within that namespace only):

- the container's namespaces (mount, pid, ipc, uts, net) and root, like `nsenter -r`;
- on cgroup v1, the container's devices cgroup, where the engine's device rules live (leaves for
  memory, pids and CPU are joined before, see process.in_cgroup);
- the user's uid, gid and supplementary groups (its own group only);
- capabilities: for root, Docker's default set without CAP_MKNOD (CAPABILITIES), as bounding,
  permitted and effective sets, nothing inheritable or ambient; any other uid has none, and the
  bounding set keeps it from gaining more;
- no_new_privs (setuid and file-capability binaries grant nothing) and daemon/seccomp.py's filter,
  the stand-in for the engine's seccomp profile, which an entered process would not otherwise get.

It is one Python program (ENTER), run with the daemon's interpreter: `python -I -S -c ENTER ...`,
about 20 ms where nsenter alone takes 2: nsenter cannot drop a root process's capabilities, and a
setpriv run after it would have to exist in the image.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import ClassVar

from corral.sdk.errors import FailedPrecondition

from ..fsaccess import SandboxFiles, openat2
from ..seccomp import LOAD_FUNCTION, RESET_SIGNALS_FUNCTION, program, supported
from ..users import ROOT, SandboxUser, check_user_spec, resolve_user
from .base import EnterCommand, ManagedSandbox

# /etc/passwd and /etc/group are read up to this size.
MAX_ID_FILE_BYTES = 4 << 20

# Docker's default capabilities for a container's root (moby's oci/caps/defaults.go), less
# CAP_MKNOD: entered processes are not in every cgroup of the container on all engines, and device
# nodes are the one thing a device cgroup alone would keep from the host's disks.
CAPABILITIES = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_RAW": 13,
    "CAP_SYS_CHROOT": 18,
    "CAP_AUDIT_WRITE": 29,
    "CAP_SETFCAP": 31,
}
CAPABILITY_MASK = sum(1 << bit for bit in CAPABILITIES.values())
# Less what acts on a network namespace: for sandboxes that share the host's (raw sockets would
# see the node's traffic; privileged ports are the node's services').
HOST_NETWORK_CAPABILITY_MASK = CAPABILITY_MASK & ~(
    1 << CAPABILITIES["CAP_NET_RAW"] | 1 << CAPABILITIES["CAP_NET_BIND_SERVICE"]
)

# What both programs below start with: libc functions by name, and how they fail.
LIBC_CALLS = r"""
import _ctypes, os, sys

class c_long(_ctypes._SimpleCData):
    _type_ = "l"
class Libc:
    _handle = _ctypes.dlopen(None, os.RTLD_NOW)
class Function(_ctypes.CFuncPtr):
    _flags_, _restype_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO, c_long

def fail(what, code=126):
    sys.stderr.write(f"corral: {what}\n")
    sys.stderr.flush()
    os._exit(code)

def call(name, *args):
    if Function((name, Libc()))(*args) == -1:
        fail(f"{name}: {os.strerror(_ctypes.get_errno())}")
"""

# argv: pid, uid, gid, capability mask, join devices cgroup (0/1), join user namespace (0/1), cwd,
# seccomp program (hex), count of environment entries, the entries, then the program's argv.
ENTER = (
    LOAD_FUNCTION
    + RESET_SIGNALS_FUNCTION
    + LIBC_CALLS
    + r"""
# Everything is imported before the root changes: the interpreter's library is the host's.
import signal, struct, warnings  # noqa: F401 (os.execvpe needs warnings)

def prctl(*args):
    call("prctl", *(c_long(a) for a in (*args, 0, 0, 0, 0)[:5]))

pid, uid, gid, caps, devices, userns, cwd, seccomp, count = sys.argv[1:10]
uid, gid, caps = int(uid), int(gid), int(caps)
env = dict(entry.split("=", 1) for entry in sys.argv[10 : 10 + int(count)])
argv = sys.argv[10 + int(count) :]
try:
    namespaces = [
        (os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC), flag)
        for name, flag in (("ipc", 0x08000000), ("uts", 0x04000000), ("net", 0x40000000), ("pid", 0x20000000), ("mnt", 0x00020000))
    ]
    if userns == "1":
        # Last, while still host root: the others may be owned by the host's (a shared network).
        namespaces.append((os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC), 0x10000000))
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    if devices == "1":
        for line in open(f"/proc/{pid}/cgroup"):
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "devices" in controllers.split(","):
                with open(f"/sys/fs/cgroup/devices{path}/cgroup.procs", "w") as procs:
                    procs.write(str(os.getpid()))
except OSError as err:
    fail(err)
for fd, flag in namespaces:
    call("setns", fd, flag)
os.fchdir(root)
os.chroot(".")
child = os.fork()
if child:
    # Outside, the parent of the program (the pid namespace takes effect for children): its exit
    # is the program's, a death by signal included. An interrupt is the program's to handle, as
    # for a shell's foreground child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    status = os.waitpid(child, 0)[1]
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) != signal.SIGKILL:  # (whose disposition cannot be set)
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)  # Python ignores SIGPIPE, handles SIGINT
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
reset_signals()  # (see seccomp.RESET_SIGNALS_FUNCTION)
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
for cap in range(last_cap + 1):
    if not caps >> cap & 1:
        prctl(PR_CAPBSET_DROP, cap)
prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
os.setgroups([gid])
os.setresgid(gid, gid, gid)
os.setresuid(uid, uid, uid)
if uid == 0:
    # _LINUX_CAPABILITY_VERSION_3: effective, permitted, inheritable, for capabilities 0-31 and 32-63.
    header = (0x20080522).to_bytes(4, "little") + bytes(4)
    low, high = caps & 0xFFFFFFFF, caps >> 32
    data = b"".join(v.to_bytes(4, "little") for v in (low, low, 0, high, high, 0))
    call("capset", header, data)
try:
    os.chdir(cwd)
except OSError as err:
    fail(f"cwd {cwd}: {err.strerror}")
if seccomp:
    load_seccomp(bytes.fromhex(seccomp))
else:
    prctl(38, 1)  # PR_SET_NO_NEW_PRIVS: no filter exists for this machine's architecture
try:
    os.execvpe(argv[0], argv, env)
except FileNotFoundError:
    fail(f"{argv[0]}: No such file or directory", 127)
except OSError as err:
    fail(f"{argv[0]}: {err.strerror}")
"""
)

# What Docker mounts read-only in every container (moby's oci/defaults.go): kernel settings that
# host uid 0 could otherwise change with no capability at all (file modes suffice for most of
# them), for instance /proc/sys/kernel/core_pattern. Apptainer leaves them writable.
READ_ONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger", "/sys")

# argv: pid, then the paths. Binds each path onto itself read-only in the mount namespace of pid.
MAKE_READ_ONLY = (
    LIBC_CALLS
    + r"""
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
root = os.open(f"/proc/{sys.argv[1]}/root", os.O_RDONLY | os.O_DIRECTORY)
call("setns", os.open(f"/proc/{sys.argv[1]}/ns/mnt", os.O_RDONLY), 0x00020000)
os.fchdir(root)
os.chroot(".")
for path in sys.argv[2:]:
    if os.path.exists(path):
        target = path.encode()
        call("mount", target, target, None, c_long(MS_BIND | MS_REC), None)
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        call("mount", None, target, None, c_long(flags), None)
"""
)


def read_only_argv(target_pid: int, python: str = sys.executable) -> list[str]:
    """The host command that makes READ_ONLY_PATHS read-only in the container of `target_pid`
    (for every process in it, once)."""
    return [python, "-I", "-S", "-c", MAKE_READ_ONLY, str(target_pid), *READ_ONLY_PATHS]


def enter_argv(
    target_pid: int,
    uid: int,
    gid: int,
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    *,
    capabilities: int,
    join_devices_cgroup: bool,
    join_user_namespace: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """The host command that runs argv in the container of `target_pid` as uid:gid (see the module
    docstring), with `capabilities` (a mask) for root, in `cwd`, with exactly `env`. With
    `join_user_namespace`, uid:gid and the capabilities are those of the container's own user
    namespace. Spawn it with nsenter.HOST_ENV."""
    return [
        python,
        "-I",
        "-S",
        "-c",
        ENTER,
        str(target_pid),
        str(uid),
        str(gid),
        str(capabilities),
        "1" if join_devices_cgroup else "0",
        "1" if join_user_namespace else "0",
        cwd,
        _seccomp_hex(),
        str(len(env)),
        *(f"{key}={value}" for key, value in env.items()),
        *argv,
    ]


@functools.cache
def _seccomp_hex() -> str:
    """The filter of entered processes ("" on architectures it does not exist for, see
    seccomp.supported: they get no_new_privs and the capabilities above only)."""
    return "" if supported() else program(entering=False).hex()


def resolve_in_image(init_pid: int, spec: str) -> SandboxUser:
    """The user `spec` names (a name, uid, uid:gid, or name:group as an image's USER may say),
    against the /etc/passwd and /etc/group the container of `init_pid` has, read within its root."""
    user, _, group = spec.partition(":")
    if not group or (user.isdigit() and group.isdigit()):
        return resolve_user(spec, _image_file(init_pid, "/etc/passwd"))
    found = resolve_user(user, _image_file(init_pid, "/etc/passwd"))
    if group.isdigit():
        return replace(found, gid=int(check_user_spec(group)))
    for line in _image_file(init_pid, "/etc/group").splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[0] == group and fields[2].isdigit():
            return replace(found, gid=int(fields[2]))
    raise FailedPrecondition(f"the image has no group {group!r} (not in its /etc/group)")


def _image_file(init_pid: int, path: str) -> str:
    """A small text file of the container's (empty when it has none), opened within its root so
    that a symlink the image or the sandbox put there cannot lead out."""
    root = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = openat2(root, path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    finally:
        os.close(root)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return file.read(MAX_ID_FILE_BYTES).decode(errors="replace")


class ImageUserSandbox(ManagedSandbox):
    """A container sandbox whose programs run as the image's users, entered with ENTER: the
    default user is the request's (SandboxSpec.user) or the image's own (`adopt_user`), and file
    access acts as that user too."""

    # Where the engine keeps device rules in a cgroup of the container (Docker, Podman on v1).
    join_devices_cgroup: ClassVar[bool] = False
    # Where the container has a user namespace of its own (Apptainer): ids inside are then not
    # the host's (host_ids).
    join_user_namespace: ClassVar[bool] = False
    # The prefix of the leaf cgroups commands run in, under the sandbox's cgroup.
    leaf_prefix: ClassVar[str] = ""
    # The default user, known once the container runs (adopt_user).
    user: SandboxUser = ROOT

    @property
    def capabilities(self) -> int:
        """Root's capabilities inside (a mask of CAPABILITIES)."""
        return CAPABILITY_MASK

    def adopt_user(self, image_user: str) -> None:
        """Takes the request's user, else `image_user` (the image's, "" = root), as the default,
        and gives it the workspace and the run directory (where kernels make their sockets)."""
        self.user = resolve_in_image(self.init_pid, self.spec.user or image_user or "root")
        for path in (self.workspace, self.run_dir):
            os.chown(path, *self.host_ids(self.user))

    def host_ids(self, user: SandboxUser) -> tuple[int, int]:
        """The host uid and gid of a user inside."""
        return user.uid, user.gid  # no user namespace: the ids inside are the host's

    def user_host_ids(self, user: str) -> tuple[int, int] | None:
        return self.host_ids(resolve_in_image(self.init_pid, user) if user else self.user)

    def home(self, user: str) -> str:
        return (resolve_in_image(self.init_pid, user) if user else self.user).home_or(self.workdir)

    def enter_command(
        self, argv: Sequence[str], *, cwd: str, leaf: str, env: Mapping[str, str], user: str = ""
    ) -> EnterCommand:
        who = resolve_in_image(self.init_pid, user) if user else self.user
        cgroup = self.cgroup.leaf(self.leaf_prefix + leaf) if self.cgroup else None
        enter = enter_argv(
            self.init_pid,
            who.uid,
            who.gid,
            argv,
            cwd or self.workdir,
            env,
            capabilities=self.capabilities,
            join_devices_cgroup=self.join_devices_cgroup,
            join_user_namespace=self.join_user_namespace,
        )
        return EnterCommand(enter, cgroup, "/")

    def make_file_access(self) -> SandboxFiles:
        return SandboxFiles(
            f"/proc/{self.init_pid}/root", self.workdir, *self.host_ids(self.user), self.context.max_file_bytes
        )
