"""The local backend of a daemon that is not root (docs/local-backend.md, "Without root"): a real
`corral serve` run as an unprivileged user, driven through the SDK.

The daemon runs as an unprivileged user (tests/integration/rootless_daemons.py: a system user
made for it when the suite runs as root, else the suite's own user). The tests skip, naming the
reason, where the kernel refuses that user an unprivileged user namespace or bubblewrap is
missing. Every process they look for on the host carries a marker of their own in its command
line."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess
from tests.integration.rootless_daemons import (
    RootlessDaemon,
    marked,
    rootless_place,
    run_harness_in_a_sandbox,
    wait_gone,
)

BUNDLED_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"


@pytest.fixture(scope="module")
def rootless() -> Iterator[RootlessDaemon]:
    with rootless_place() as place:
        yield place


@pytest.fixture(scope="module")
def rootless_daemon(rootless) -> Iterator[DaemonProcess]:
    with rootless.running("shared") as daemon:
        yield daemon


@pytest.fixture
def client(rootless_daemon):
    from corral.sdk import Client

    with Client(rootless_daemon.address) as c:
        yield c


def test_node_info_says_rootless(client):
    info = client.node_info()
    assert info.rootless
    local = next(b for b in info.backends if b.backend == "local")
    assert local.available, local.detail
    assert "ROOTLESS" in local.detail
    assert "overlayfs" in local.detail or "copy" in local.detail
    limits = {limit.kind: limit for limit in local.limits}
    # Nothing is claimed that an ordinary user cannot enforce (test_rootless_limits.py checks each).
    assert not limits["disk"].enforced
    for kind in ("memory", "pids", "cpu"):
        assert limits[kind].enforced == ("cgroup" in limits[kind].mechanism), limits[kind]


def test_lifecycle_exec_shell_files(client, rootless_daemon, tmp_path):
    sandbox_dirs = rootless_daemon.state_dir / "sandboxes"
    with client.create_sandbox(image="host") as sb:
        r = sb.exec(["id", "-u"], timeout=30)
        assert (r.exit_code, r.stdout) == (0, b"0\n")
        # The root is writable without touching the host's: a new top-level directory, a file
        # in /usr's overlay.
        r = sb.exec("mkdir /testbed && touch /usr/corral-rootless-probe && echo ok", timeout=30)
        assert r.stdout == b"ok\n", r
        assert not os.path.exists("/usr/corral-rootless-probe")
        sb.write_file("data/a.txt", b"payload\n")
        assert sb.read_file("/workspace/data/a.txt") == b"payload\n"
        assert sb.exec("cat data/a.txt", timeout=30).stdout == b"payload\n"
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "b.bin").write_bytes(bytes(range(256)) * 64)
        sb.upload(tmp_path / "up", "/workspace/in")
        assert sb.exec("sha256sum in/up/b.bin | cut -c1-8", timeout=30).exit_code == 0
        back = sb.download("/workspace/in/up", tmp_path / "back")
        assert (back / "b.bin" if back.name == "up" else back / "up" / "b.bin").read_bytes() == (
            tmp_path / "up" / "b.bin"
        ).read_bytes()
        shell = sb.shell("main")
        shell.run("cd /tmp && export X=41")
        turn = shell.run("echo $((X + 1)); pwd", timeout=30)
        assert turn.output == b"42\n/tmp\n"
        assert list(sandbox_dirs.iterdir())
    assert not list(sandbox_dirs.iterdir()), "destroy left the sandbox's directory"


def test_only_root_inside(client):
    from corral.sdk.errors import FailedPrecondition

    with client.create_sandbox(image="host") as sb, pytest.raises(FailedPrecondition, match="only root"):
        sb.exec(["id"], user="nobody", timeout=30)


def test_kernel(client):
    from tests.conftest import require_kernel_python

    require_kernel_python("local")
    with client.create_sandbox(image="host") as sb:
        kernel = sb.kernel()
        kernel.execute("x = 21")
        assert kernel.execute("x * 2").result_text == "42"


def test_bundled_tasks_reach_reward_1_through_the_rollout_service(client):
    """The rollout service of a daemon without root: every bundled repair task through the replay
    policy (INIT, the agent's turns, evaluation in a clean sandbox) to reward 1.0."""
    from corral.rollout.reference.replay import ReplayPolicy
    from corral.rollout.reference.server import ReferenceServer
    from corral.sdk.tasks import load_tasks

    tasks = load_tasks(BUNDLED_TASKS)
    server = ReferenceServer(ReplayPolicy(tasks))
    url = server.start_in_thread()
    try:
        info = client.rollouts.register_llm(url)
        try:
            results = [client.rollouts.run(task, timeout=300) for task in tasks]
        finally:
            client.rollouts.remove_llm(info.address)
    finally:
        server.stop_in_thread()
    assert [(r.task_id, r.status, r.reward) for r in results] == [(t.task_id, "completed", 1.0) for t in tasks]


def test_a_harness_in_a_sandbox_reaches_the_gateway_and_nothing_else(client):
    """A harness task inside a rootless sandbox (network off), whose network namespace the daemon
    may not enter itself: it reaches the gateway on the sandbox's loopback, not the LLM server on
    the node's, and the rollout is token-exact."""
    run_harness_in_a_sandbox(client)


def test_a_sandbox_with_network_runs_commands_on_the_hosts_network(client):
    """network=True: the sandbox is on the host's network namespace (an unprivileged daemon may
    not join it, and need not), and commands, shells and kernels still enter it."""
    with client.create_sandbox(image="host", network=True) as sb:
        r = sb.exec(["sh", "-c", "readlink /proc/self/ns/net"], timeout=30)
        assert r.exit_code == 0 and r.stdout.strip() == os.readlink("/proc/self/ns/net").encode(), r
        assert sb.shell("net").run("echo in-shell", timeout=30).output == b"in-shell\n"
    with client.create_sandbox(image="host") as sb:
        r = sb.exec(["sh", "-c", "readlink /proc/self/ns/net"], timeout=30)
        assert r.exit_code == 0 and r.stdout.strip() != os.readlink("/proc/self/ns/net").encode(), r


def test_two_sandboxes_cannot_see_each_other(client):
    marker = f"corral-rootless-{secrets.token_hex(4)}"
    with client.create_sandbox(image="host") as a, client.create_sandbox(image="host") as b:
        a.write_file(f"/workspace/{marker}", b"a's\n")
        assert a.exec(f"echo a > /tmp/{marker} && touch /usr/{marker}", timeout=30).exit_code == 0
        a.exec(f"exec -a {marker} sleep 600 >/dev/null 2>&1 &", timeout=30)
        assert a.exec(f"pgrep -f {marker}", timeout=30).exit_code == 0
        # (The bracket keeps the pattern from matching the command line that holds it.)
        seen = b.exec(f"ps -eo args | grep -c '[{marker[0]}]{marker[1:]}'", timeout=30)
        assert seen.stdout == b"0\n", seen
        for path in (f"/workspace/{marker}", f"/tmp/{marker}", f"/usr/{marker}"):
            assert b.exec(["test", "-e", path], timeout=30).exit_code == 1, path
        # Nor can it signal the other's process by its host pid: no such pid exists in its namespace.
        (host_pid,) = marked(marker)
        b.exec(f"kill -9 {host_pid}", timeout=30)
        assert marked(marker) == {host_pid}
    assert not wait_gone(marker), "destroy left a process of the sandbox"


def test_timeout_kills_the_whole_tree(client):
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    with client.create_sandbox(image="host") as sb:
        r = sb.exec(
            f"setsid sleep 1{marker} & (sleep 2{marker} &) ; sleep 3{marker} & sleep 4{marker}",
            timeout=2,
        )
        assert r.timed_out
        left = sb.exec(f"ps -eo args | grep '[s]leep [1-4]{marker}'", timeout=30).stdout
        # The double-forked one (its parent gone before the timeout) is the documented exception.
        assert left.split(b"\n")[:-1] in ([], [f"sleep 2{marker}".encode()]), left


def test_daemon_killed_takes_its_sandboxes_along(rootless):
    daemon = rootless.start("killed")
    marker = f"corral-rootless-{secrets.token_hex(4)}"
    try:
        from corral.sdk import Client

        with Client(daemon.address) as c:
            sb = c.create_sandbox(image="host")
            sb.exec(f"exec -a {marker}-bg sleep 600 >/dev/null 2>&1 &", timeout=30)
            sb.shell("main").run(f"exec -a {marker}-shell sleep 600 &", timeout=30)
        deadline = time.monotonic() + 10
        while len(marked(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # (the shell's job may not have exec'd yet when its turn ends)
        assert len(marked(marker)) == 2
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)
        assert not wait_gone(marker), "a sandbox process outlived its daemon"
        # The next start reaps what the killed one left.
        restarted = rootless.start("killed")
        try:
            assert not list((restarted.state_dir / "sandboxes").iterdir())
        finally:
            restarted.stop()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()


def test_directory_image(client):
    from tests.conftest import SWE_ROOTFS_IMAGE, require_image

    require_image("local", local_image=SWE_ROOTFS_IMAGE)
    with client.create_sandbox(image=SWE_ROOTFS_IMAGE) as sb:
        r = sb.exec(
            "grep -c bookworm /etc/os-release; mkdir /scratch && echo made > /scratch/x && cat /scratch/x", timeout=30
        )
        assert r.exit_code == 0 and r.stdout.endswith(b"made\n"), r
        # Host root's files are nobody's inside: readable, not writable.
        assert sb.exec("echo x >> /etc/os-release", timeout=30).exit_code != 0


def test_container_image(client, rootless):
    from tests.integration.test_local_images import require_tools, small_image

    require_tools()
    layouts = rootless.root / "layouts"
    layouts.mkdir(mode=0o755, exist_ok=True)
    image = small_image(layouts, f"image-{secrets.token_hex(4)}")
    subprocess.run(["chmod", "-R", "a+rX", str(layouts)], check=True)
    with client.create_sandbox(image=image, user="root", timeout=300) as sb:
        # Unpacked rootless, every file is the daemon's user's: root inside owns them all.
        r = sb.exec(["/bin/sh", "-c", "echo x >> /bin/cat && echo ok"], timeout=30)
        assert r.stdout == b"ok\n", r
