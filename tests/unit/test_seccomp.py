"""The seccomp program of local sandboxes: what it answers per system call (run through a small
classic-BPF interpreter here), and the program loaded for real into a child process."""

from __future__ import annotations

import errno
import struct
import subprocess
import sys

import pytest

from corral.daemon import seccomp
from corral.daemon.backends.local.backend import LocalSettings

pytestmark = pytest.mark.skipif(bool(seccomp.supported()), reason=seccomp.supported() or "")

EPERM = seccomp.RET_ERRNO | errno.EPERM
ALLOW = seccomp.RET_ALLOW
CLONE_THREAD_FLAGS = 0x3D0F00  # glibc's pthread_create: VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|...
FORK_FLAGS = 0x01200011  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWTIME = 0x10000000, 0x00020000, 0x80


def run_filter(prog: bytes, nr: int, arg0: int = 0, arch: int = seccomp.AUDIT_ARCH_X86_64) -> int:
    """What the kernel would do with the call: the filter's return value."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == seccomp.LD_W_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == seccomp.RET_K:
            return k
        else:
            taken = {seccomp.JEQ_K: acc == k, seccomp.JGE_K: acc >= k, seccomp.JSET_K: bool(acc & k)}[code]
            pc += jt if taken else jf


@pytest.fixture(scope="module")
def prog() -> bytes:
    return seccomp.program()


def test_refused_calls_get_eperm(prog):
    for name, nr in seccomp.DENIED_X86_64.items():
        assert run_filter(prog, nr) == EPERM, name
    for nr in (0, 1, 2, 57, 59, 60, 101, 161):  # read, write, open, fork, execve, exit, ptrace, chroot
        assert run_filter(prog, nr) == ALLOW, nr


def test_clone_and_unshare_are_refused_only_with_new_namespaces(prog):
    assert run_filter(prog, seccomp.NR_CLONE, CLONE_THREAD_FLAGS) == ALLOW
    assert run_filter(prog, seccomp.NR_CLONE, FORK_FLAGS) == ALLOW
    assert run_filter(prog, seccomp.NR_CLONE, FORK_FLAGS | CLONE_NEWUSER) == EPERM
    assert run_filter(prog, seccomp.NR_CLONE, CLONE_NEWNS | 17) == EPERM
    assert run_filter(prog, seccomp.NR_CLONE, 0x80 | 0x11) == ALLOW  # the exit signal's bits, not CLONE_NEWTIME
    assert run_filter(prog, seccomp.NR_UNSHARE, 0x400) == ALLOW  # CLONE_FILES
    for flag in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWTIME):
        assert run_filter(prog, seccomp.NR_UNSHARE, flag) == EPERM, hex(flag)
    # clone3's flags are in memory the filter cannot read: ENOSYS makes libc fall back to clone.
    assert run_filter(prog, seccomp.NR_CLONE3) == seccomp.RET_ERRNO | errno.ENOSYS


def test_personality_allows_dockers_values_only(prog):
    for value in seccomp.PERSONALITIES:
        assert run_filter(prog, seccomp.NR_PERSONALITY, value) == ALLOW, hex(value)
    assert run_filter(prog, seccomp.NR_PERSONALITY, 0x0400000) == EPERM  # READ_IMPLIES_EXEC


def test_other_system_call_interfaces_are_killed(prog):
    assert run_filter(prog, 1, arch=0x40000003) == seccomp.RET_KILL_PROCESS  # i386
    assert run_filter(prog, seccomp.X32_SYSCALL_BIT | 1) == seccomp.RET_KILL_PROCESS  # x32


def test_the_entering_variant_allows_setns_only_more(prog):
    entering = seccomp.program(entering=True)
    nr_setns = seccomp.DENIED_X86_64["setns"]
    assert run_filter(prog, nr_setns) == EPERM and run_filter(entering, nr_setns) == ALLOW
    for name, nr in seccomp.DENIED_X86_64.items():
        if name not in seccomp.ENTERING_NEEDS:
            assert run_filter(entering, nr) == EPERM, name


LOADED_PROBE = r"""
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x10000000) == -1 and ctypes.get_errno() == 1
t = threading.Thread(target=print, args=("thread",)); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(3)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_loader_runs_a_program_under_the_filter():
    r = subprocess.run(
        [*seccomp.loader_argv(sys.executable), sys.executable, "-c", LOADED_PROBE], capture_output=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"thread\nfork 3\n"


def test_config_takes_default_or_none():
    LocalSettings(seccomp="none").validate()
    with pytest.raises(ValueError, match="seccomp must be one of default, none"):
        LocalSettings(seccomp="strict").validate()
