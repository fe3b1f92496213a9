"""CreateSandbox's host bind mounts through the API on every backend: a daemon whose
`sandbox.bind_roots` allows one directory; read-only unless asked, writable ones show the sandbox's
files on the host, nothing outside the roots, and the host directory unchanged by a read-only
mount. (The checks of the paths themselves: tests/unit/test_bind_mounts.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from corral.sdk import Client, Mount, errors
from tests.conftest import BACKEND_CASES, DaemonProcess, require_backend, require_image


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_mode}:{st.st_uid}".encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(params=list(BACKEND_CASES))
def bind_daemon(request, tmp_path):
    requirement, backend, case_config = BACKEND_CASES[request.param]
    require_backend(requirement)
    require_image(requirement)
    roots = tmp_path / "roots"
    roots.mkdir()
    config = tmp_path / "corral.toml"
    config.write_text(f'{case_config}\n[sandbox]\nbind_roots = ["{roots}"]\n')
    (tmp_path / "daemon").mkdir()  # apart from the roots: a root holding the daemon's files is refused
    daemon = DaemonProcess(tmp_path / "daemon", "--config", str(config)).start()
    try:
        yield daemon, roots, backend
    finally:
        daemon.stop()


def test_bind_mounts_are_read_only_unless_asked_and_only_under_the_roots(bind_daemon, tmp_path):
    daemon, roots, backend = bind_daemon
    shared, scratch = roots / "shared", roots / "scratch"
    shared.mkdir()
    (shared / "data.txt").write_text("host data\n")
    scratch.mkdir()
    scratch.chmod(0o777)
    before = digest(shared)
    mounts = [Mount(str(shared), "/mnt/shared"), Mount(str(scratch), "/data/scratch", writable=True)]
    with Client(daemon.address) as client:
        with client.create_sandbox(mounts=mounts, timeout=120) as sandbox:
            r = sandbox.exec("cat /mnt/shared/data.txt && touch /data/scratch/made && echo made", timeout=30)
            assert r.stdout == b"host data\nmade\n", r.stderr
            hostile = sandbox.exec(
                "echo x > /mnt/shared/data.txt; rm -f /mnt/shared/data.txt; touch /mnt/shared/new; "
                "chmod 777 /mnt/shared; mount -o remount,rw /mnt/shared; echo done",
                timeout=30,
            )
            assert hostile.stdout == b"done\n"
            assert sandbox.exec("cat /mnt/shared/data.txt", timeout=30).stdout == b"host data\n"
            assert [(m.host_path, m.sandbox_path, m.writable) for m in sandbox.info.mounts] == [
                (str(scratch), "/data/scratch", True),
                (str(shared), "/mnt/shared", False),
            ]
        assert digest(shared) == before
        made = scratch / "made"
        assert made.exists()
        if backend == "local":
            # Root inside is the first id of the sandbox's unprivileged host id block.
            assert made.stat().st_uid >= 65536
        outside = tmp_path / "outside"
        outside.mkdir()
        with pytest.raises(errors.PermissionDenied):
            client.create_sandbox(mounts=[Mount(str(outside), "/mnt/x")], timeout=60)
        assert client.list_sandboxes() == []
