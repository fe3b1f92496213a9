"""The local backend's seccomp filter, seen from inside a sandbox under each launcher: what it
refuses (namespaces, mounts, the keyring), what keeps working (threads, fork, subprocess,
multiprocessing), and the opt-out (local.seccomp = "none")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral.sdk import Client
from tests.integration.test_local_isolation import LAUNCHERS, start_daemon

# Each probe prints "<name> <errno or ok>", through libc (os.unshare is Python >= 3.12).
PROBES = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def report(name, rc):
    print(name, ctypes.get_errno() if rc == -1 else "ok", flush=True)
report("unshare-user", libc.unshare(0x10000000))
report("unshare-mount", libc.unshare(0x00020000))
report("mount", libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
report("keyctl", libc.syscall(250, 0, -4, 0))  # KEYCTL_GET_KEYRING_ID of the user keyring
report("setns", libc.setns(os.open("/proc/self/ns/uts", os.O_RDONLY), 0))
"""

WORKLOAD = r"""
import multiprocessing, os, subprocess, threading
t = threading.Thread(target=print, args=("thread",)); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(subprocess.run(["echo", "subprocess"], capture_output=True, text=True).stdout.strip())
print("pool", multiprocessing.Pool(2).map(abs, [-1, -2]))
"""


@pytest.fixture(
    scope="module", params=[(launcher, profile) for launcher in LAUNCHERS for profile in ("default", "none")]
)
def daemon(request, tmp_path_factory) -> Iterator[tuple[object, str]]:
    launcher, profile = request.param
    d = start_daemon(tmp_path_factory.mktemp(f"seccomp-{launcher}-{profile}"), launcher, f'seccomp = "{profile}"\n')
    yield d, profile
    d.stop()


@pytest.fixture
def sb(daemon):
    d, _ = daemon
    with Client(d.address) as c, c.create_sandbox(image="host") as sandbox:
        yield sandbox


def probe(sb) -> dict[str, str]:
    r = sb.exec(["python3", "-c", PROBES], timeout=30)
    assert r.exit_code == 0, r.stderr
    return dict(line.split() for line in r.stdout.decode().splitlines())


def test_filter_refuses_namespaces_mounts_and_the_keyring(sb, daemon):
    _, profile = daemon
    results = probe(sb)
    if profile == "none":
        # Without the filter, the kernel's own checks decide: a user namespace is allowed to an
        # unprivileged uid (where the host's sysctls allow it), and keyctl works.
        assert results["keyctl"] == "ok", results
        return
    assert results == {name: "1" for name in results}, results  # EPERM everywhere
    for flag in ("-U", "-r"):
        r = sb.exec(["unshare", flag, "true"], timeout=10)
        assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, (flag, r.exit_code, r.stderr)


def test_filter_is_on_every_process_of_the_sandbox(sb, daemon):
    _, profile = daemon
    expected = "2" if profile == "default" else "0"  # /proc/PID/status Seccomp: 2 = filter
    for argv in (["grep", "^Seccomp:", "/proc/self/status"], ["sh", "-c", "grep ^Seccomp: /proc/$$/status"]):
        r = sb.exec(argv, timeout=10)
        assert r.stdout.split() == [b"Seccomp:", expected.encode()], (argv, r.stdout, r.stderr)
    with sb.shell() as shell:
        r = shell.run("grep ^Seccomp: /proc/$$/status", timeout=10)
        assert r.output.split()[-1] == expected.encode(), r.output


def test_ordinary_work_is_unaffected(sb):
    r = sb.exec(["python3", "-c", WORKLOAD], timeout=60)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split("\n")[:4] == ["thread", "fork 7", "subprocess", "pool [1, 2]"], r.stdout


def test_programs_get_default_signal_dispositions(sb):
    """The filter's loader is a Python step, and Python ignores SIGPIPE and SIGXFSZ: the program
    it starts must not inherit that (`yes | head -n1` would print "Broken pipe")."""
    r = sb.exec("grep ^SigIgn: /proc/self/status; yes | head -n1", timeout=10)
    assert r.stdout == b"SigIgn:\t0000000000000000\ny\n" and r.stderr == b"", (r.stdout, r.stderr)


def test_node_info_says_whether_sandboxes_have_the_filter(daemon):
    d, profile = daemon
    with Client(d.address) as c:
        [status] = [b for b in c.node_info().backends if b.backend == "local"]
    expected = "seccomp filter: default" if profile == "default" else 'NO SECCOMP FILTER (local.seccomp = "none")'
    assert status.detail.endswith(expected), status.detail


def test_commands_without_namespaces_are_filtered_too(tmp_path):
    """local.isolation = "none": the filter is all that stands between a command and new
    namespaces; the command is found in PATH like any other."""
    d = start_daemon(tmp_path, "none", "allow_no_isolation = true\n")
    try:
        with Client(d.address) as c, c.create_sandbox(image="host") as sb:
            r = sb.exec(["grep", "^Seccomp:", "/proc/self/status"], timeout=10)
            assert r.stdout.split() == [b"Seccomp:", b"2"], (r.stdout, r.stderr)
            r = sb.exec(["unshare", "-U", "true"], timeout=10)
            assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, (r.exit_code, r.stderr)
    finally:
        d.stop()
