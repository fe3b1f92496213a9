"""Root inside a container sandbox (docker, podman, singularity): what root can do in its own
sandbox (write anywhere, changes gone with the sandbox) and what it cannot do to the node
(docs/backends.md, "Users inside")."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from corral.daemon.backends.base import BindMount, Limits, SandboxSpec
from corral.daemon.backends.container_enter import CAPABILITY_MASK
from corral.daemon.cgroups import CgroupDriver
from corral.daemon.commands import DEFAULT_PATH
from corral.daemon.config import SandboxConfig, load_config
from corral.daemon.node import make_backends
from corral.daemon.process import in_cgroup
from corral.sdk import errors
from tests.conftest import BACKEND_CASES, DOCKER_TEST_IMAGE, ROOT_INSIDE, SIF_TEST_IMAGE, require_backend, require_image

CONTAINER_CASES = [case for case, (_, backend, _) in BACKEND_CASES.items() if backend in ROOT_INSIDE]


@pytest.fixture
def root_sandbox(daemon, client):
    if daemon.backend not in ROOT_INSIDE:
        pytest.skip(f"the {daemon.backend} backend does not run as root inside here")
    with client.create_sandbox() as sb:
        yield sb


def _python(sandbox, code: str, **kw):
    return sandbox.exec(["python3", "-c", code], timeout=30, **kw)


def test_root_by_default_with_dockers_capabilities_only(root_sandbox):
    r = root_sandbox.exec(
        "id -u; id -g; grep -E '^(CapEff|CapBnd|CapInh|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status"
    )
    lines = r.stdout.decode().split("\n")
    assert lines[:2] == ["0", "0"]
    status = dict(line.split(":\t") for line in lines[2:] if line)
    assert int(status["CapEff"], 16) == int(status["CapBnd"], 16) == CAPABILITY_MASK
    assert int(status["CapInh"], 16) == int(status["CapAmb"], 16) == 0
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"


def test_no_raw_sockets_in_the_hosts_network(daemon, client):
    """Apptainer's networked sandboxes share the host's network namespace: root there gets no
    raw sockets (which would see the node's traffic) and no privileged ports."""
    if daemon.backend != "singularity":
        pytest.skip("a networked sandbox has a network namespace of its own on this backend")
    with client.create_sandbox(network=True) as sb:
        r = _python(sb, "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)")
        assert r.exit_code != 0 and b"PermissionError" in r.stderr
        r = _python(sb, "import socket; socket.socket().bind(('127.0.0.1', 80))")
        assert r.exit_code != 0 and b"PermissionError" in r.stderr


def test_programs_get_default_signal_dispositions(root_sandbox):
    """The entering step is a Python program, which ignores SIGPIPE and SIGXFSZ: the program must
    get every signal as usual, none ignored and none blocked."""
    r = root_sandbox.exec("yes | head -n 1; grep -E '^Sig(Ign|Blk):' /proc/self/status", timeout=10)
    assert r.stdout == b"y\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n" and r.stderr == b"", r


def test_killing_every_process_from_inside_spares_the_sandbox_and_orphans_are_reaped(root_sandbox):
    """kill(-1) as root inside reaches every process of the sandbox but its pid 1 (the
    evaluation of a rollout does it to stop the agent's): the sandbox must live on, and orphans
    must not stay zombies (they count against the pids limit)."""
    r = root_sandbox.exec("sleep 60 >/dev/null 2>&1 & kill -9 -1; echo survived", timeout=10)
    assert r.stdout == b"survived\n", r
    r = root_sandbox.exec(
        "(sleep 0.1 >/dev/null 2>&1 &); sleep 1; grep -l '^State:.*Z' /proc/[0-9]*/status | wc -l", timeout=10
    )
    assert r.stdout == b"0\n", r


def test_root_writes_anywhere_and_it_vanishes_with_the_sandbox(client, root_sandbox):
    r = root_sandbox.exec(
        "touch /usr/x && echo ok && echo edited >> /etc/debian_version && cat /root/.bashrc >/dev/null"
    )
    assert r.stdout == b"ok\n", r.stderr
    root_sandbox.write_file("/usr/local/bin/from-files", b"#!/bin/sh\necho written\n", mode=0o755)
    assert root_sandbox.exec(["from-files"], timeout=10).stdout == b"written\n"
    assert root_sandbox.exec("stat -c %u:%g /workspace", timeout=10).stdout == b"0:0\n"
    with client.create_sandbox() as other:
        r = other.exec("test -e /usr/x || echo gone; grep -c edited /etc/debian_version", timeout=10)
        assert r.stdout == b"gone\n0\n"


def test_root_cannot_mount_load_modules_or_make_namespaces(root_sandbox):
    code = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(nr, *args):
    return 0 if libc.syscall(nr, *args) == 0 else os.strerror(ctypes.get_errno())
print("mount", errno_of(165, b"none", b"/mnt", b"tmpfs", 0, None))
print("finit_module", errno_of(313, os.open("/etc/hostname", os.O_RDONLY), b"", 0))
print("unshare-user", errno_of(272, 0x10000000))
print("unshare-mount", errno_of(272, 0x00020000))
print("setns", errno_of(308, os.open("/proc/self/ns/mnt", os.O_RDONLY), 0))
print("keyctl", errno_of(250, 0, -3, 0, 0, 0))
print("mknod", errno_of(133, b"/tmp/sda", 0o60600, os.makedev(8, 0)))
"""
    results = dict(line.split(" ", 1) for line in _python(root_sandbox, code).stdout.decode().splitlines())
    assert results == {name: "Operation not permitted" for name in results}, results
    assert len(results) == 7


def test_kernel_settings_are_read_only(root_sandbox):
    """Host uid 0 may write most of /proc/sys and /sys by file mode alone: they must be read-only."""
    for path in ("/proc/sys/vm/swappiness", "/proc/sys/kernel/core_pattern", "/sys/kernel/mm/ksm/run"):
        r = root_sandbox.exec(f"cat {path} > /tmp/v && cat /tmp/v > {path}", timeout=10)
        assert r.exit_code != 0 and b"Read-only file system" in r.stderr, (path, r)


def test_no_escalation_through_a_setuid_binary(root_sandbox):
    r = root_sandbox.exec(
        "cp /usr/bin/id /usr/local/bin/suid-id && chmod 4755 /usr/local/bin/suid-id && "
        "setpriv --reuid=65534 --regid=65534 --clear-groups /usr/local/bin/suid-id -u",
        timeout=10,
    )
    assert r.stdout == b"65534\n", r.stderr


def test_host_processes_daemon_and_network_out_of_reach(daemon, root_sandbox):
    assert root_sandbox.exec(["kill", "-0", str(os.getpid())], timeout=10).exit_code != 0
    assert root_sandbox.exec(["test", "-e", str(daemon.state_dir)], timeout=10).exit_code != 0
    assert root_sandbox.exec(["test", "-e", str(daemon.socket)], timeout=10).exit_code != 0
    code = r"""
import socket
print(sorted(name for _, name in socket.if_nameindex()))
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
try:
    s.sendto(b"\x08\x00\xf7\xff\x00\x00\x00\x00", ("192.0.2.1", 0))
except OSError as err:
    print(err.strerror)
"""
    assert _python(root_sandbox, code).stdout == b"['lo']\nNetwork is unreachable\n"


HOST_FILES = ("/etc/localtime", "/etc/hosts", "/etc/resolv.conf", "/etc/passwd", "/etc/group")


def test_a_hostile_root_leaves_the_image_and_host_unchanged(daemon, client, root_sandbox):
    before = _image_digest(daemon.backend), [_file_digest(p) for p in HOST_FILES]
    root_sandbox.exec(
        "for f in /etc/localtime /etc/hosts /etc/resolv.conf /etc/passwd /etc/group; do echo x > $f; done; "
        "rm -rf --no-preserve-root / 2>/dev/null; chmod -R 777 /usr 2>/dev/null; "
        "dd if=/dev/zero of=/usr/bin/python3 bs=1k count=1 2>/dev/null; true",
        timeout=60,
    )
    assert (_image_digest(daemon.backend), [_file_digest(p) for p in HOST_FILES]) == before
    with client.create_sandbox() as fresh:
        assert fresh.exec(["python3", "-c", "print(1)"], timeout=10).stdout == b"1\n"


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if os.path.exists(path) else ""


def _image_digest(backend: str) -> str:
    if backend == "singularity":
        return _file_digest(SIF_TEST_IMAGE)
    return subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Id}} {{.RootFS.Layers}}", DOCKER_TEST_IMAGE],
        capture_output=True,
        text=True,
    ).stdout


# Bind mounts and users, through the backend itself (the API passes SandboxSpec.mounts and .user).


def _tree_digest(root: Path) -> dict[str, tuple]:
    return {
        str(p.relative_to(root)): (p.stat().st_mode, p.stat().st_uid, p.read_bytes() if p.is_file() else b"")
        for p in sorted(root.rglob("*"))
    }


async def _run_in(sandbox, script: str, user: str = "") -> subprocess.CompletedProcess:
    enter = sandbox.enter_command(
        ["/bin/sh", "-c", script], cwd="", leaf=sandbox.next_leaf("t"), env={"PATH": DEFAULT_PATH}, user=user
    )
    return await asyncio.to_thread(
        subprocess.run, in_cgroup(enter.argv, enter.cgroup), env=enter.env, capture_output=True, timeout=60
    )


def _in_backend_sandbox(case: str, tmp_path: Path, scenario, image: str = "", **spec) -> None:
    """Runs `await scenario(sandbox)` in a sandbox made by the case's backend itself, in this
    process, from SandboxSpec fields the API does not pass yet; destroys it whatever happens."""
    requirement, name, config_text = BACKEND_CASES[case]
    require_backend(requirement)
    require_image(requirement)
    config_file = tmp_path / "corral.toml"
    config_file.write_text(config_text)
    config = load_config(config_file, state_dir=str(tmp_path / "state"))
    daemon_id = uuid.uuid4().hex[:8]
    backend = make_backends(config, CgroupDriver(daemon_id), daemon_id)[name]
    sandbox_spec = SandboxSpec(f"sb-{daemon_id}", image or backend.default_image(), Limits(), network=False, **spec)

    async def run() -> None:
        try:
            sandbox = await backend.create(sandbox_spec)
            try:
                await scenario(sandbox)
            finally:
                await sandbox.destroy()
        finally:
            await backend.close()

    asyncio.run(run())


@pytest.mark.parametrize("case", CONTAINER_CASES)
def test_bind_mounts_and_users(case, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the scratch directory is given to the sandbox's host ids, which takes root")
    shared, scratch = tmp_path / "shared", tmp_path / "scratch"
    shared.mkdir()
    (shared / "data.txt").write_text("host data\n")
    scratch.mkdir(mode=0o777)
    scratch.chmod(0o777)
    # The sandbox's root's: the first block of host ids of a fresh backend (daemon/uids.py).
    first_id = SandboxConfig().uid_base
    os.chown(scratch, first_id, first_id)
    before = _tree_digest(shared)

    async def scenario(sandbox) -> None:
        r = await _run_in(sandbox, "id -un; cat /mnt/shared/data.txt; touch /workspace/w && echo workspace")
        assert r.stdout == b"nobody\nhost data\nworkspace\n", r.stderr
        r = await _run_in(
            sandbox,
            "echo x > /mnt/shared/data.txt; rm -f /mnt/shared/data.txt; touch /mnt/shared/new; "
            "chmod 777 /mnt/shared; touch /mnt/scratch/by-root; id -u",
            user="root",
        )
        assert r.stdout == b"0\n" and r.stderr.count(b"Read-only file system") == 4, r.stderr
        r = await _run_in(sandbox, "touch /mnt/scratch/by-nobody && echo ok", user="65534:65534")
        assert r.stdout == b"ok\n", r.stderr
        with pytest.raises(errors.FailedPrecondition, match="no user 'no-such-user'"):
            await _run_in(sandbox, "true", user="no-such-user")
        with pytest.raises(errors.InvalidArgument):
            await _run_in(sandbox, "true", user="not a user")

    mounts = (BindMount(str(shared), "/mnt/shared"), BindMount(str(scratch), "/mnt/scratch", read_only=False))
    _in_backend_sandbox(case, tmp_path, scenario, user="nobody", mounts=mounts)
    assert _tree_digest(shared) == before
    # Bind mounts are idmapped onto the sandbox's block of host ids (docs/backends.md): root's
    # files are its first id's on the host, nobody's (65534 inside) first + 65534's.
    assert (scratch / "by-root").stat().st_uid == first_id
    assert (scratch / "by-nobody").stat().st_uid == first_id + 65534


def test_the_images_user_is_the_default_for_programs_and_files(tmp_path):
    require_backend("docker")
    require_image("docker")
    image = "corral-test/python-as-nobody:test"
    dockerfile = f"FROM {DOCKER_TEST_IMAGE}\nUSER nobody:nogroup\n"
    subprocess.run(
        ["docker", "build", "-q", "-t", image, "-"], input=dockerfile.encode(), check=True, capture_output=True
    )

    async def scenario(sandbox) -> None:
        r = await _run_in(sandbox, "id -u; id -g; stat -c %u:%g /workspace; touch /usr/x")
        assert r.stdout == b"65534\n65534\n65534:65534\n" and b"Permission denied" in r.stderr, r
        files = sandbox.file_access()
        await asyncio.to_thread(files.write, "/workspace/by-files", b"x", 0o644, False)
        r = await _run_in(sandbox, "stat -c %u:%g /workspace/by-files")
        assert r.stdout == b"65534:65534\n"
        with pytest.raises(errors.PermissionDenied):
            await asyncio.to_thread(files.write, "/usr/by-files", b"x", 0o644, False)
        assert (await _run_in(sandbox, "id -un", user="root")).stdout == b"root\n"
        for spec, ids in (("nobody:0", b"65534 0"), ("root:nogroup", b"0 65534"), ("7:7", b"7 7")):
            assert (await _run_in(sandbox, "echo $(id -u) $(id -g)", user=spec)).stdout == ids + b"\n"

    try:
        _in_backend_sandbox("docker", tmp_path, scenario, image=image)
    finally:
        subprocess.run(["docker", "image", "rm", image], capture_output=True)
