"""ForkSandbox on the Apptainer backend: children start from a copy of their parent's root
writable layer and workspace (reflinks where the filesystem has them), with the files' owners
moved to each child's own block of host ids; siblings and the parent stay isolated, forks of forks
work. The tests look only at their own daemon's sandboxes."""

from __future__ import annotations

import time

import pytest

from corral.sdk import Client
from tests.conftest import SIF_TEST_IMAGE, DaemonProcess, require_backend, require_image

CONFIG = f'[daemon]\ndefault_backend = "singularity"\n[singularity]\ndefault_image = "{SIF_TEST_IMAGE}"\n'


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    require_backend("singularity")
    require_image("singularity")
    root = tmp_path_factory.mktemp("apptainer-fork")
    (root / "corral.toml").write_text(CONFIG)
    daemon = DaemonProcess(root, "--config", str(root / "corral.toml")).start()
    try:
        with Client(daemon.address) as c:
            yield c
    finally:
        daemon.stop()


def sh(sandbox, script: str, **kw) -> str:
    r = sandbox.exec(script, timeout=60, **kw)
    assert r.exit_code == 0, r
    return r.stdout.decode()


def test_children_start_from_the_parent_isolated_in_blocks_of_their_own(client):
    with client.create_sandbox() as parent:
        sh(
            parent,
            "echo root-layer > /usr/local/forked && echo ws > /workspace/w && rm /etc/debian_version && "
            "install -d -o 1000 -g 1000 /workspace/u && echo mine > /workspace/u/f && chown 1000:1000 /workspace/u/f",
        )
        started = time.monotonic()
        children = parent.fork(2)
        took = time.monotonic() - started
        try:
            a, b = children
            firsts = {parent.info.host_id_first, a.info.host_id_first, b.info.host_id_first}
            assert len(firsts) == 3 and 0 not in firsts
            for child in children:
                assert sh(
                    child, "cat /usr/local/forked /workspace/w /workspace/u/f; test -e /etc/debian_version || echo gone"
                ) == ("root-layer\nws\nmine\ngone\n")
                assert sh(child, "stat -c %u:%g /usr/local/forked /workspace/u/f") == "0:0\n1000:1000\n"
                assert sh(child, "echo more >> /workspace/u/f && echo ok", user="1000") == "ok\n"
            sh(a, "echo a > /usr/local/forked && rm /workspace/w && touch /workspace/only-a")
            assert sh(b, "cat /usr/local/forked /workspace/w; ls /workspace") == "root-layer\nws\nu\nw\n"
            assert sh(parent, "cat /usr/local/forked /workspace/w; ls /workspace") == "root-layer\nws\nu\nw\n"
            (grandchild,) = a.fork(1)
            with grandchild:
                assert sh(grandchild, "cat /usr/local/forked; ls /workspace") == "a\nonly-a\nu\n"
                assert grandchild.info.labels["corral.fork.generation"] == "2"
        finally:
            for child in children:
                child.destroy()
    print(f"fork of 2 children: {took * 1000:.0f} ms")
