"""A root daemon shared by ordinary users (daemon.socket_group): each user's sandboxes are invisible
to the others on every RPC that names one (NOT_FOUND), lists show a user's own, root sees all, and
a user outside the group is refused with the group named.

The test makes its own group and users (groupadd, useradd; removed after) and runs each user's
calls in a process of that user (runuser) through tests/ownership_probes.py as a script."""

from __future__ import annotations

import grp
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral.sdk import Client
from tests.conftest import DaemonProcess, require_backend, require_kernel_python, shared_daemon_config
from tests.ownership_probes import PROBES, not_found_details

REPO = Path(__file__).resolve().parents[2]
BTRFS = '[local]\nstorage = "btrfs"\nstorage_bytes = 8589934592\n'  # (snapshots need it)
# Runs tests/ownership_probes.py with the venv's packages, in whatever python the user may run.
BOOTSTRAP = (
    "import runpy, site, sys; site.addsitedir(sys.argv[1]); sys.path.insert(0, sys.argv[2]); "
    "sys.argv = ['ownership_probes', *sys.argv[3:]]; runpy.run_module('tests.ownership_probes', run_name='__main__')"
)


@dataclass
class SharedNode:
    daemon: DaemonProcess
    group: str
    alice: str
    bob: str
    eve: str  # not in the group
    python: str
    home: Path

    def as_user(self, user: str, *args: str) -> dict:
        """One action of tests/ownership_probes.py's script, in a process of `user`."""
        site_dir = sysconfig.get_paths()["purelib"]
        done = subprocess.run(
            ["runuser", "-u", user, "--", "env", f"HOME={self.home}", "PYTHONDONTWRITEBYTECODE=1"]
            + [self.python, "-c", BOOTSTRAP, site_dir, str(REPO), args[0], self.daemon.address, *args[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.home,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _user_python(user: str, home: Path) -> str:
    """This interpreter where `user` may run it (the venv's base lies under root's home on some
    machines), else the system's python of the same version."""
    for python in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        probe = subprocess.run(["runuser", "-u", user, "--", python, "-c", "pass"], capture_output=True, cwd=home)
        if probe.returncode == 0:
            return python
    pytest.skip(f"no python {sys.version_info.major}.{sys.version_info.minor} that user {user} may run")


@pytest.fixture(scope="module")
def node() -> Iterator[SharedNode]:
    if os.geteuid() != 0:
        pytest.skip("needs root: it makes a group and users (groupadd, useradd) and runs as them (runuser)")
    for tool in ("groupadd", "useradd", "userdel", "groupdel", "runuser"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    require_backend("local")
    require_kernel_python("local")
    tag = secrets.token_hex(3)
    group, alice, bob, eve = (f"crl{tag}", f"crl{tag}a", f"crl{tag}b", f"crl{tag}e")
    root = Path(tempfile.mkdtemp(prefix="corral-shared-"))  # (under /tmp: the users must reach the socket)
    os.chmod(root, 0o711)
    home = root / "home"
    home.mkdir(mode=0o1777)
    os.chmod(home, 0o1777)
    made_users: list[str] = []
    daemon: DaemonProcess | None = None
    try:
        _run("groupadd", group)
        for user, groups in ((alice, [group]), (bob, [group]), (eve, [])):
            _run("useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *(["-G", ",".join(groups)] if groups else []), user)
            made_users.append(user)
        config = root / "corral.toml"
        config.write_text(shared_daemon_config(f'[daemon]\nsocket_group = "{group}"\n' + BTRFS))
        daemon = DaemonProcess(root, "--config", str(config)).start()
        yield SharedNode(daemon, group, alice, bob, eve, _user_python(alice, home), home)
    finally:
        if daemon is not None:
            daemon.stop()
        for user in made_users:
            subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_the_socket_is_root_and_the_groups_only(node) -> None:
    info = os.stat(node.daemon.socket)
    assert stat.S_IMODE(info.st_mode) == 0o660
    assert (info.st_uid, grp.getgrgid(info.st_gid).gr_name) == (0, node.group)


def test_a_users_sandbox_is_not_found_for_another_user_on_every_rpc(node) -> None:
    target = node.as_user(node.alice, "make")
    answers = node.as_user(node.bob, "probe", json.dumps(target))
    assert set(answers) == set(PROBES)
    assert {name: answer for name, answer in answers.items() if answer[0] != "NOT_FOUND"} == {}
    for name, (_, details) in answers.items():
        if "napshot" not in name:
            assert details == not_found_details(target["sandbox_id"]), name
    # Alice's is whole, and only hers.
    mine = node.as_user(node.alice, "list")
    assert target["sandbox_id"] in mine["sandboxes"] and target["snapshot"] in mine["snapshots"]
    theirs = node.as_user(node.bob, "list")
    assert target["sandbox_id"] not in theirs["sandboxes"] and target["snapshot"] not in theirs["snapshots"]
    with Client(node.daemon.address) as root:
        sandbox = root.get_sandbox(target["sandbox_id"])
        assert sandbox.read_file("secret.txt") == b"the owner's"
        assert not any(entry.name == "planted.txt" for entry in sandbox.list_dir("."))
        assert [k.id for k in sandbox.list_kernels()] == [target["kernel_id"]]
        assert any(p.id == target["process_id"] and p.running for p in sandbox.list_processes())


def test_root_sees_every_users_sandboxes_and_each_user_only_theirs(node) -> None:
    alices = node.as_user(node.alice, "make")["sandbox_id"]
    bobs = node.as_user(node.bob, "make")["sandbox_id"]
    with Client(node.daemon.address) as root:
        roots = root.create_sandbox()
        assert {alices, bobs, roots.id} <= {sb.id for sb in root.list_sandboxes()}
        alice_sees = node.as_user(node.alice, "list")["sandboxes"]
        assert alices in alice_sees and bobs not in alice_sees and roots.id not in alice_sees
        roots.destroy()


def test_a_user_outside_the_group_is_refused_with_the_group_named(node) -> None:
    answer = node.as_user(node.eve, "refuse")
    assert answer["error"] == "Unavailable" and "Permission denied" in answer["message"]
    assert f"group {node.group!r}" in answer["hint"] and "start" not in answer["hint"]
