"""Root inside a local sandbox, nobody outside: each sandbox's user namespace maps ids 0-65535 to a
host id block of its own, its root is a copy-on-write overlay of the image on its own size-capped
filesystem, and root inside can change nothing of the host. Under each launcher; every host path
here is one the test makes and removes itself, or one it only reads."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.sdk import Client, errors
from tests.conftest import ROOTLESS_HERE
from tests.integration.local_images import make_rootfs
from tests.integration.test_local_isolation import LAUNCHERS, start_daemon

# A root daemon's local backend (its id blocks, mounts and launchers): rootless is another mode.
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason=ROOTLESS_HERE)

UID_BASE = 1_500_000  # the daemon's default sandbox.uid_base
INSIDE_IDS = 65536
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
# Host paths a "host" sandbox sees, that the hostile script below goes after.
HOST_TARGETS = ("/etc/passwd", "/etc/hostname", "/etc/os-release", "/usr/bin", "/usr/share/doc/coreutils")


def digest(*paths: str | Path) -> str:
    """A digest of each path's metadata and content, recursively for directories."""
    h = hashlib.sha256()
    for top in map(str, paths):
        entries = [top]
        if os.path.isdir(top) and not os.path.islink(top):
            for parent, dirs, files in os.walk(top):
                dirs.sort()
                entries += sorted(os.path.join(parent, name) for name in [*dirs, *files])
        for path in entries:
            st = os.lstat(path)
            h.update(f"{path} {st.st_mode} {st.st_uid} {st.st_gid} {st.st_size} {st.st_mtime_ns}\n".encode())
            if os.path.isfile(path) and not os.path.islink(path) and st.st_size < 1 << 20:
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


# As root inside: every change to the image or the host it can try.
HOSTILE = r"""
touch /usr/x /etc/x /usr/bin/x
echo hacked >> /etc/passwd
echo hacked > /etc/hostname
rm -f /etc/os-release /usr/bin/id
rm -rf /usr/share/doc/coreutils
chmod 777 /usr/bin /etc
chown 1234:1234 /etc/passwd
mount -t tmpfs none /mnt 2>/dev/null && echo MOUNTED
umount /usr 2>/dev/null && echo UNMOUNTED
umount -l / 2>/dev/null && echo UNMOUNTED
mount -o remount,rw / 2>/dev/null && echo REMOUNTED
mknod /tmp/sda b 8 0 2>/dev/null && echo MKNOD
true
"""


@pytest.fixture(scope="module", params=LAUNCHERS)
def launcher_daemon(request, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp(f"local-root-{request.param}"), request.param)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def image() -> Iterator[Path]:
    """A root filesystem image any user may reach, with a setuid-root copy of `id`."""
    with tempfile.TemporaryDirectory(prefix="corral-test-", dir="/srv") as parent:
        os.chmod(parent, 0o755)
        image = make_rootfs(Path(parent) / "image")
        suid = image / "bin" / "id-suid"
        suid.write_bytes((image / "bin" / "id").read_bytes())
        suid.chmod(0o4755)
        yield image


@pytest.fixture
def client(launcher_daemon):
    with Client(launcher_daemon.address) as c:
        yield c


def host_workspace(daemon, sandbox_id: str) -> Path:
    return daemon.state_dir / "sandboxes" / sandbox_id / "workspace"


def host_range(sandbox) -> tuple[int, int]:
    """The host ids the sandbox's inside ids 0.. map to: (first, count)."""
    inside, first, count = sandbox.exec(["cat", "/proc/self/uid_map"], timeout=10).stdout.split()
    assert inside == b"0"
    return int(first), int(count)


@pytest.mark.parametrize("image_kind", ["host", "rootfs"])
def test_root_inside_is_an_unprivileged_host_id_block(launcher_daemon, client, image, image_kind):
    with client.create_sandbox(image="host" if image_kind == "host" else str(image)) as sb:
        r = sb.exec("id -u; id -g; id -un", timeout=10)
        assert r.stdout == b"0\n0\nroot\n", r.stderr
        first, count = host_range(sb)
        assert first >= UID_BASE and count == INSIDE_IDS
        # A file made in the workspace (a bind mount of a host directory) is the block's on the host.
        sb.exec(["touch", "/workspace/made-inside"], timeout=10).check()
        made = os.stat(host_workspace(launcher_daemon, sb.id) / "made-inside")
        assert (made.st_uid, made.st_gid) == (first, first)
        # The image's files, host root's, are root's inside; the workspace is root's.
        assert sb.exec(["stat", "-c", "%u:%g", "/usr", "/etc/passwd", "/workspace"], timeout=10).stdout == (
            b"0:0\n" * 3
        )


def test_sandboxes_get_disjoint_id_blocks(client):
    with client.create_sandbox(image="host") as a, client.create_sandbox(image="host") as b:
        (first_a, count), (first_b, _) = host_range(a), host_range(b)
        assert abs(first_a - first_b) >= count


@pytest.mark.parametrize("image_kind", ["host", "rootfs"])
def test_root_is_writable_copy_on_write_and_the_host_never_changes(client, image, image_kind):
    targets = HOST_TARGETS if image_kind == "host" else (str(image),)
    before = digest(*targets)
    with client.create_sandbox(image="host" if image_kind == "host" else str(image)) as sb:
        r = sb.exec(HOSTILE, timeout=60)
        assert r.exit_code == 0 and r.stdout == b"", (r.stdout, r.stderr)
        # Every change happened, inside.
        seen = sb.exec(
            "ls /usr/x /etc/x && tail -n1 /etc/passwd && stat -c %a /etc && ! test -e /usr/bin/id", timeout=10
        )
        assert seen.exit_code == 0 and b"hacked" in seen.stdout and b"777" in seen.stdout, seen.stderr
        with client.create_sandbox(image="host" if image_kind == "host" else str(image)) as fresh:
            r = fresh.exec("test -e /usr/x || test -e /etc/x || grep hacked /etc/passwd", timeout=10)
            assert r.exit_code == 1, "one sandbox's changes reached another"
    assert digest(*targets) == before, "the sandbox changed the host"
    assert not os.path.exists("/usr/x") and not os.path.exists("/etc/x")


def test_root_writes_count_against_the_disk_limit(client):
    with client.create_sandbox(image="host", disk_bytes=32 << 20) as sb:
        r = sb.exec("dd if=/dev/zero of=/usr/big bs=1M count=64", timeout=60)
        assert r.exit_code != 0 and b"No space left on device" in r.stderr, r.stderr
        sb.exec("rm /usr/big && touch /usr/small", timeout=10).check()  # the space comes back


def test_files_api_acts_as_the_default_user(launcher_daemon, client):
    with client.create_sandbox(image="host") as sb:
        sb.write_file("/usr/local/from-api", b"hello")
        assert sb.exec(["stat", "-c", "%u %s", "/usr/local/from-api"], timeout=10).stdout == b"0 5\n"
        sb.write_file("made-by-api", b"x")  # relative: in the workspace
        first, _ = host_range(sb)
        assert os.stat(host_workspace(launcher_daemon, sb.id) / "made-by-api").st_uid == first
        with pytest.raises(Exception, match="ermission"):
            sb.read_file("/etc/shadow")  # a host secret stays covered


PYTHON_PROBES = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def refused(call, *args):
    return libc.syscall(call, *args) == -1 and ctypes.get_errno() in (errno.EPERM, errno.EACCES)
print("init_module", refused(175, None, 0, b""))
fd = os.open("/usr/bin/true", os.O_RDONLY)
print("finit_module", refused(313, fd, b"", 0))
print("ptrace_init", refused(101, 16, 1, None, None))  # PTRACE_ATTACH to the sandbox's pid 1
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    print("raw_socket", False)
except PermissionError:
    print("raw_socket", True)
try:
    open("/proc/sysrq-trigger", "w").write("h")
    print("sysrq", False)
except OSError:
    print("sysrq", True)
"""


def test_root_inside_cannot_load_modules_trace_init_or_open_raw_sockets(client):
    with client.create_sandbox(image="host") as sb:
        r = sb.exec(["python3", "-c", PYTHON_PROBES], timeout=30)
        assert r.exit_code == 0, r.stderr
        results = dict(line.split() for line in r.stdout.decode().splitlines())
        assert results == dict.fromkeys(("init_module", "finit_module", "ptrace_init", "raw_socket", "sysrq"), "True")


def test_no_host_device_can_be_mounted(client):
    device = next((d for d in ("/dev/sda", "/dev/vda", "/dev/nvme0n1", "/dev/loop0") if os.path.exists(d)), "")
    if not device:
        pytest.skip("no block device on this host to try")
    with client.create_sandbox(image="host") as sb:
        r = sb.exec(f"test -e {device} && echo VISIBLE; mount {device} /mnt && echo MOUNTED", timeout=10)
        assert b"VISIBLE" not in r.stdout and b"MOUNTED" not in r.stdout, r.stdout


def test_the_daemon_socket_and_state_are_out_of_reach(launcher_daemon, client):
    with client.create_sandbox(image="host") as sb:
        for path in (launcher_daemon.socket, launcher_daemon.state_dir, launcher_daemon.state_dir / "sandboxes"):
            r = sb.exec(["ls", "-d", str(path)], timeout=10)
            assert r.exit_code != 0, f"{path} is reachable from the sandbox"


def test_setuid_binaries_in_the_image_do_not_escalate(client, image):
    with client.create_sandbox(image=str(image)) as sb:
        first, _ = host_range(sb)
        assert sb.exec(["stat", "-c", "%u %a", "/bin/id-suid"], timeout=10).stdout == b"0 4755\n"
        # Another user inside runs the setuid-root program: it stays that user.
        r = sb.exec([*AS_NOBODY, "/bin/id-suid", "-u"], timeout=10)
        assert r.stdout == b"65534\n", (r.stdout, r.stderr)
        # And root inside is the block's first host id, never host root.
        status = sb.exec(["cat", "/proc/self/status"], timeout=10).stdout.decode()
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert uids == ["0"] * 4
        assert first != 0


def mounts_under(path: Path) -> list[str]:
    """The mount points at or below `path` (a directory of this test's) in this mount namespace."""
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == str(path) or p.startswith(f"{path}/")]


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("disk_bytes", [0, 32 << 20])  # 0: no capped filesystem, the root's mounts alone
def test_destroy_and_a_crash_leave_no_mount_of_the_root(launcher, disk_bytes, tmp_path, image):
    d = start_daemon(tmp_path, launcher, "")
    (tmp_path / "corral.toml").write_text(f'[local]\nisolation = "{launcher}"\n[limits]\ndisk_bytes = {disk_bytes}\n')
    d.stop()
    d.start()
    try:
        with Client(d.address) as c:
            with c.create_sandbox(image="host") as on_host, c.create_sandbox(image=str(image)) as on_image:
                # A running sandbox's root is its init's alone: the daemon's copy went once the init
                # held one (every launcher copies the daemon's mounts, so they must not pile up).
                for sb in (on_host, on_image):
                    assert mounts_under(d.state_dir / "sandboxes" / sb.id / "root") == []
                    assert sb.exec(["ls", "/etc", "/bin/sh"]).exit_code == 0
                # What stays mounted: the capped filesystems, one per sandbox.
                assert len(mounts_under(d.state_dir)) == (2 if disk_bytes else 0)
            assert mounts_under(d.state_dir) == []
            c.create_sandbox(image="host")
            c.create_sandbox(image=str(image))
        d.stop(signal.SIGKILL)
        d.start()  # reaps what the killed daemon left
        assert mounts_under(d.state_dir) == []
    finally:
        d.stop()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_an_image_on_a_filesystem_without_idmapped_mounts_is_failed_precondition(launcher, tmp_path):
    # An overlayfs mount of this test's: the kernel cannot idmap it (nor use it as an overlay layer).
    with tempfile.TemporaryDirectory(prefix="corral-test-", dir="/srv") as parent:
        os.chmod(parent, 0o755)
        base = Path(parent)
        for sub in ("lower", "upper", "work", "merged"):
            (base / sub).mkdir()
        make_rootfs(base / "lower" / "image")
        options = f"lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work"
        subprocess.run(["mount", "-t", "overlay", "-o", options, "corral-test", str(base / "merged")], check=True)
        try:
            (base / "merged").chmod(0o755)
            d = start_daemon(tmp_path, launcher)
            try:
                with Client(d.address) as c, pytest.raises(errors.FailedPrecondition, match="idmapped mounts"):
                    c.create_sandbox(image=str(base / "merged" / "image"))
                assert mounts_under(d.state_dir) == []
            finally:
                d.stop()
        finally:
            subprocess.run(["umount", "-l", str(base / "merged")], check=False)
