"""The seccomp filter of local sandboxes: a classic-BPF program assembled here, with no library.

It follows Docker's default profile in what it refuses, as a deny list (everything else allowed):
namespaces (clone/unshare with a CLONE_NEW* flag; clone3, whose flags the filter cannot read,
answers ENOSYS so that libc falls back to clone), mounts (old and new mount API), modules, kexec,
bpf, perf_event_open, userfaultfd, the kernel keyring, file handles, io_uring, reboot, swap,
syslog, acct, the clock, quotas, iopl/ioperm, kcmp, process_vm_readv/writev and personality
values other than Docker's few. Refused calls fail with EPERM. ptrace stays allowed, as in Docker
on Linux >= 4.8: the filter is re-checked after a tracer changes a call, the tracee must be the
sandbox's own uid in its own pid namespace, and debuggers and profilers are ordinary tools.

Only x86-64 system calls are allowed: a process entering the kernel through the i386 or x32
interfaces (whose numbers differ, so a deny list by number would not hold) is killed.

The program goes to bubblewrap (`--seccomp FD`) or is loaded by LOADER (prctl PR_SET_SECCOMP after
PR_SET_NO_NEW_PRIVS); every process of a sandbox inherits it.
"""

from __future__ import annotations

import errno
import platform
import struct

# The seccomp filter of every process that enters a sandbox runs from the host-side step that
# enters it (nsenter), which itself needs setns. Without capabilities, which a sandbox's uid never
# has, and with no user namespace of its own, the kernel refuses setns there anyway.
ENTERING_NEEDS = frozenset({"setns"})

DENIED_X86_64 = {
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "setns": 308,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "reboot": 169,
    "swapon": 167,
    "swapoff": 168,
    "syslog": 103,
    "acct": 163,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "quotactl": 179,
    "quotactl_fd": 443,
    "lookup_dcookie": 212,
    "iopl": 172,
    "ioperm": 173,
    "kcmp": 312,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "uselib": 134,
}
NR_CLONE, NR_UNSHARE, NR_CLONE3, NR_PERSONALITY = 56, 272, 435, 135
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET; unshare also takes CLONE_NEWTIME
# (0x80), which in clone's flags is part of the exit signal instead.
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
UNSHARE_NEW_FLAGS = CLONE_NEW_FLAGS | 0x00000080
# Docker's: the default, UNAME26, ADDR_NO_RANDOMIZE, both, and the query (0xffffffff).
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

# Classic BPF (linux/filter.h, linux/seccomp.h)
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K, JGE_K, JSET_K = 0x15, 0x35, 0x45  # BPF_JMP | BPF_JEQ/JGE/JSET | BPF_K
RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
RET_KILL_PROCESS = 0x80000000
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16  # struct seccomp_data (arg0's low half: little-endian)


# (opcode, jump if true, jump if false, k); a label (str) as opcode names the next instruction, as
# a jump a forward jump to it.
Instruction = tuple[int | str, int | str, int | str, int]


class SeccompUnsupported(Exception):
    """The filter has no system call table for this machine's architecture."""


def supported() -> str:
    """Why this machine cannot have the filter ("" when it can)."""
    machine = platform.machine()
    return "" if machine == "x86_64" else f"the seccomp filter exists for x86_64 only, not {machine}"


def program(entering: bool = False) -> bytes:
    """The filter as an array of struct sock_filter. `entering`: the variant for the host-side step
    that enters a live sandbox (ENTERING_NEEDS allowed)."""
    reason = supported()
    if reason:
        raise SeccompUnsupported(reason)
    denied = sorted(nr for name, nr in DENIED_X86_64.items() if not (entering and name in ENTERING_NEEDS))
    eperm = RET_ERRNO | errno.EPERM
    # Instructions whose jump target is a label: (code, true label, false label, k), resolved below.
    code: list[Instruction] = [
        (LD_W_ABS, 0, 0, OFFSET_ARCH),
        (JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (RET_K, 0, 0, RET_KILL_PROCESS),
        (LD_W_ABS, 0, 0, OFFSET_NR),
        (JGE_K, "kill", 0, X32_SYSCALL_BIT),
        *((JEQ_K, "eperm", 0, nr) for nr in denied),
        (JEQ_K, "enosys", 0, NR_CLONE3),
        (JEQ_K, "clone", 0, NR_CLONE),
        (JEQ_K, "unshare", 0, NR_UNSHARE),
        (JEQ_K, "personality", 0, NR_PERSONALITY),
        (RET_K, 0, 0, RET_ALLOW),
        ("eperm", 0, 0, 0),
        (RET_K, 0, 0, eperm),
        ("enosys", 0, 0, 0),
        (RET_K, 0, 0, RET_ERRNO | errno.ENOSYS),
        ("kill", 0, 0, 0),
        (RET_K, 0, 0, RET_KILL_PROCESS),
        ("clone", 0, 0, 0),
        (LD_W_ABS, 0, 0, OFFSET_ARG0),
        (JSET_K, 0, 1, CLONE_NEW_FLAGS),
        (RET_K, 0, 0, eperm),
        (RET_K, 0, 0, RET_ALLOW),
        ("unshare", 0, 0, 0),
        (LD_W_ABS, 0, 0, OFFSET_ARG0),
        (JSET_K, 0, 1, UNSHARE_NEW_FLAGS),
        (RET_K, 0, 0, eperm),
        (RET_K, 0, 0, RET_ALLOW),
        ("personality", 0, 0, 0),
        (LD_W_ABS, 0, 0, OFFSET_ARG0),
        *((JEQ_K, len(PERSONALITIES) - i, 0, value) for i, value in enumerate(PERSONALITIES)),
        (RET_K, 0, 0, eperm),
        (RET_K, 0, 0, RET_ALLOW),
    ]
    return _assemble(code)


def _assemble(code: list[Instruction]) -> bytes:
    """Resolves labels into relative jumps and packs struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}."""
    labels: dict[str, int] = {}
    instructions: list[Instruction] = []
    for op, jt, jf, k in code:
        if isinstance(op, str):
            labels[op] = len(instructions)
        else:
            instructions.append((op, jt, jf, k))
    out = b""
    for index, (op, jt, jf, k) in enumerate(instructions):
        jumps = [labels[j] - index - 1 if isinstance(j, str) else j for j in (jt, jf)]
        if not all(0 <= j <= 255 for j in jumps):
            raise ValueError(f"instruction {index}: jump out of range {jumps}")
        out += struct.pack("=HBBI", op, *jumps, k)
    return out


# Loads the program given in hex as argv[1] into this process and execs argv[2:] (found in PATH).
# no_new_privs comes first (the kernel's condition for a filter without CAP_SYS_ADMIN); a root
# process keeps its capabilities through exec under it, and the sandbox's mounts are nosuid
# already. Run as `python -I -S -c LOADER HEX PROGRAM...`: the daemon's own interpreter with
# nothing imported from the environment, a few milliseconds.
LOAD_FUNCTION = r"""
def load_seccomp(program):
    # _ctypes, not ctypes: importing ctypes costs more than the rest of this step together.
    import _ctypes, os, struct
    class c_long(_ctypes._SimpleCData):
        _type_ = "l"
    class c_char(_ctypes._SimpleCData):
        _type_ = "c"
    class Filter(_ctypes.Array):
        _type_, _length_ = c_char, len(program)
    class Libc:
        _handle = _ctypes.dlopen(None, os.RTLD_NOW)
    class Function(_ctypes.CFuncPtr):
        _flags_, _restype_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO, c_long
    prctl = Function(("prctl", Libc()))
    instructions = Filter.from_buffer_copy(program)
    fprog = struct.pack("=HxxxxxxQ", len(program) // 8, _ctypes.addressof(instructions))  # struct sock_fprog
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    zero = c_long(0)
    if prctl(c_long(PR_SET_NO_NEW_PRIVS), c_long(1), zero, zero, zero) or prctl(
        c_long(PR_SET_SECCOMP), c_long(SECCOMP_MODE_FILTER), fprog, zero, zero
    ):
        raise SystemExit(f"cannot load the seccomp filter: {os.strerror(_ctypes.get_errno())}")
"""
# The program must get every signal as any program does. Python ignores SIGPIPE and SIGXFSZ (else
# `yes | head -n1` prints "Broken pipe"), an ignored signal stays ignored across exec, and the
# signal mask stays too. (What the daemon's own launcher ignored, the daemon reset at its start:
# server.reset_inherited_signals. A SIGINT the kernel launcher ignores on purpose stays ignored.)
RESET_SIGNALS_FUNCTION = r"""
import signal
def reset_signals():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
"""
LOADER = (
    LOAD_FUNCTION
    + RESET_SIGNALS_FUNCTION
    + r"""
import os, sys
reset_signals()
load_seccomp(bytes.fromhex(sys.argv[1]))
os.execvp(sys.argv[2], sys.argv[2:])
"""
)


def loader_argv(python: str, entering: bool = True) -> list[str]:
    """The command prefix that runs what follows under the filter."""
    return [python, "-I", "-S", "-c", LOADER, program(entering).hex()]
