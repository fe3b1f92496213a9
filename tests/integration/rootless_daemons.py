"""Daemons run as an unprivileged user, for the tests of what a daemon without root does
(test_rootless*.py): run as root (CI), they make a system user for it (ROOTLESS_USER) and start
the daemon as that user; run as an ordinary user, they start it as themselves. Processes the tests
look for on the host carry a marker of their own in their command lines (`marked`)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess

ROOTLESS_USER = "corral-rootless"
# Debian's own interpreter, for a user who cannot execute the test's (a virtual environment's
# base interpreter under root's home, say): the same minor version loads the same packages.
SYSTEM_PYTHON = "/usr/bin/python3"


def unprivileged_user() -> pwd.struct_passwd:
    """The unprivileged user the daemon runs as: this process's own, or (as root) ROOTLESS_USER,
    made when missing."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    try:
        return pwd.getpwnam(ROOTLESS_USER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ROOTLESS_USER],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"cannot make the unprivileged user {ROOTLESS_USER}: {made.stderr.strip()}")
        return pwd.getpwnam(ROOTLESS_USER)


def as_user(user: pwd.struct_passwd) -> list[str]:
    """The prefix that runs a command as `user` in place (setpriv execs: the pid stays the daemon's)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]


def runs(user: pwd.struct_passwd, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*as_user(user), *argv], capture_output=True, text=True, timeout=30)


def interpreter(user: pwd.struct_passwd) -> str:
    """An interpreter the user may execute that loads this environment's packages."""
    if runs(user, "env", sys.executable, "-c", "pass").returncode == 0:
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    probe = runs(user, "env", SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])")
    if probe.returncode == 0 and probe.stdout.strip() == version:
        return SYSTEM_PYTHON
    pytest.skip(f"{user.pw_name} can execute neither {sys.executable} nor a Python {version} at {SYSTEM_PYTHON}")


def require_unprivileged_namespaces(user: pwd.struct_passwd) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap): a daemon without root needs it")
    made = runs(user, "unshare", "--user", "--map-root-user", "true")
    if made.returncode != 0:
        pytest.skip(f"this kernel refuses {user.pw_name} an unprivileged user namespace: {made.stderr.strip()}")


def site_bootstrap(root: Path) -> Path:
    """A directory for PYTHONPATH whose sitecustomize adds this environment's site-packages (and
    its .pth files: corral's editable install) to an interpreter other than the environment's."""
    boot = root / "boot"
    boot.mkdir()
    site_dir = sysconfig.get_paths()["purelib"]
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({site_dir!r})\n")
    return boot


class RootlessDaemon:
    """Where the unprivileged daemon's files lie, and how to start one there."""

    def __init__(self, user: pwd.struct_passwd) -> None:
        self.user = user
        # Under /tmp, not pytest's root-only directory: the daemon's user must reach it.
        self.root = Path(tempfile.mkdtemp(prefix="corral-rootless-"))
        self.root.chmod(0o755)
        self.python = interpreter(user)
        boot = site_bootstrap(self.root)
        if os.geteuid() == 0:
            for path in (self.root, boot, boot / "sitecustomize.py"):
                os.chown(path, user.pw_uid, user.pw_gid)
        self.boot = boot

    def start(self, name: str, cgroup: Path | None = None) -> DaemonProcess:
        """A daemon with its socket and state under root/name (the same name: the same state),
        started in `cgroup` (a cgroup v2 directory) when one is given."""
        home = self.root / name
        if not home.exists():
            home.mkdir(mode=0o755)
            if os.geteuid() == 0:
                os.chown(home, self.user.pw_uid, self.user.pw_gid)
        env = [f"HOME={home}", f"TMPDIR={home}", f"PYTHONPATH={self.boot}"]
        prefix = [*as_user(self.user), "env", *env]
        if cgroup is not None:  # (joined before the user changes: the cgroup's parent may be root's)
            prefix = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *prefix]
        return DaemonProcess(home, prefix=prefix, python=self.python).start(timeout=60)

    @contextlib.contextmanager
    def running(self, name: str) -> Iterator[DaemonProcess]:
        """start(name), stopped at the end of the block."""
        daemon = self.start(name)
        try:
            yield daemon
        finally:
            daemon.stop()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def rootless_place(
    require: Callable[[pwd.struct_passwd], None] = require_unprivileged_namespaces,
) -> Iterator[RootlessDaemon]:
    """A place for unprivileged daemons, once `require` (which skips, naming why) is met."""
    user = unprivileged_user()
    require(user)
    place = RootlessDaemon(user)
    try:
        yield place
    finally:
        place.remove()


def marked(marker: str) -> set[int]:
    """Host pids of live processes whose command line holds `marker` (zombies count as gone)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "cmdline").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.add(int(entry.name))
    return found


def wait_gone(marker: str, timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run_harness_in_a_sandbox(client, *, backend: int = 0, image: str = "") -> None:
    """Runs replay_harness.py's sandbox mode as a harness task on a rootless daemon (`client`):
    reward 1.0, three gateway calls, token-exact, and the node's LLM server out of its reach (the
    harness exits 5 if it can reach it)."""
    from corral.rollout.reference.server import ReferenceServer
    from corral.v1 import rollout_pb2 as pb
    from tests.integration.test_harness_tasks import RecordingReplay, assert_token_exact, harness_task

    task = harness_task(f"rootless-harness-{backend}", "local", place=pb.HARNESS_PLACE_SANDBOX)
    task.backend, task.image = backend, image  # type: ignore[assignment]
    policy = RecordingReplay([task])
    server = ReferenceServer(policy)
    url = server.start_in_thread()
    try:
        info = client.rollouts.register_llm(url)
        task.harness.env["PROBE_URL"] = info.address + "/health"
        try:
            result = client.rollouts.run(task, timeout=300)
        finally:
            client.rollouts.remove_llm(info.address)
    finally:
        server.stop_in_thread()
    assert result.status == "completed", result.error
    assert result.reward == 1.0 and result.gateway is not None and result.gateway.calls == 3
    assert_token_exact(result, policy)
