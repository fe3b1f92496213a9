"""Who programs run as in a local sandbox: its default user (CreateSandbox's `user`, else root) and
a call's own `user`, resolved against the sandbox's /etc/passwd, as ids of the sandbox's user
namespace. Driven through the backend in this process (the wire's `user` fields are the
services'), under each launcher."""

from __future__ import annotations

import asyncio
import os
import secrets
import tempfile
from pathlib import Path

import pytest

from corral.daemon.backends.base import Limits, SandboxSpec
from corral.daemon.backends.local.backend import LocalBackend, LocalSandbox
from corral.daemon.cgroups import CgroupDriver
from corral.daemon.commands import DEFAULT_PATH
from corral.daemon.config import load_config
from corral.daemon.node import make_backends
from corral.daemon.process import HostProcess
from corral.sdk.errors import FailedPrecondition
from tests.conftest import require_backend
from tests.integration.local_images import make_rootfs
from tests.integration.test_local_isolation import LAUNCHERS


def backend_for(launcher: str, state: Path, cgroups: CgroupDriver) -> LocalBackend:
    state.mkdir()
    config_file = state / "corral.toml"
    config_file.write_text(f'[daemon]\nstate_dir = "{state}"\n[local]\nisolation = "{launcher}"\n')
    config = load_config(config_file, environ={})
    backend = make_backends(config, cgroups, cgroups.daemon_id, backend_classes={"local": LocalBackend})["local"]
    assert isinstance(backend, LocalBackend) and backend.status().available, backend.status().detail
    return backend


async def output(sandbox, argv: list[str], user: str = "") -> bytes:
    enter = sandbox.enter_command(argv, cwd="", leaf="t", env={"PATH": DEFAULT_PATH}, user=user)
    process = HostProcess(enter.argv, env=enter.env, stdin=None, cgroup=None, cwd=enter.cwd)
    out = bytearray()
    done = await process.run(lambda stream, data: out.extend(data) if stream == 1 else None, 20)
    assert done.exit_code == 0, (argv, user, done)
    return bytes(out)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_default_user_and_call_user(launcher, tmp_path):
    require_backend("local")

    async def scenario(backend: LocalBackend, image: Path) -> None:
        def spec(user: str) -> SandboxSpec:
            return SandboxSpec(f"sb-{secrets.token_hex(6)}", str(image), Limits(disk_bytes=64 << 20), False, user=user)

        rooted = await backend.create(spec(""))
        try:
            assert await output(rooted, ["id", "-u"]) == b"0\n"
            assert await output(rooted, ["id", "-un"], user="nobody") == b"nobody\n"
            assert await output(rooted, ["id"], user="1234:4321") == b"uid=1234 gid=4321 groups=4321\n"
            # A user added inside is found: the passwd read is the sandbox's own, as it is now.
            await output(rooted, ["sh", "-c", "echo 'agent:x:1000:1000::/home/agent:/bin/sh' >> /etc/passwd"])
            assert await output(rooted, ["id", "-u"], user="agent") == b"1000\n"
            with pytest.raises(FailedPrecondition, match="no user 'ghost'"):
                rooted.enter_command(["true"], cwd="", leaf="t", env={}, user="ghost")
        finally:
            await rooted.destroy()
        nobody = await backend.create(spec("nobody"))
        assert isinstance(nobody, LocalSandbox)
        try:
            assert await output(nobody, ["id", "-u"]) == b"65534\n"
            # The workspace is the default user's, and the files API acts as that user's host id.
            assert await output(nobody, ["stat", "-c", "%u", "/workspace"]) == b"65534\n"
            first = nobody.uid
            assert os.stat(nobody.workspace).st_uid == first + 65534
            files = nobody.file_access()
            files.write("/workspace/by-api", b"x", 0o644, False)
            assert await output(nobody, ["stat", "-c", "%u", "/workspace/by-api"]) == b"65534\n"
        finally:
            await nobody.destroy()
        with pytest.raises(FailedPrecondition, match="no user 'ghost'"):
            await backend.create(spec("ghost"))

    with tempfile.TemporaryDirectory(prefix="corral-test-", dir="/srv") as parent:
        os.chmod(parent, 0o755)
        image = make_rootfs(Path(parent) / "image")
        cgroups = CgroupDriver(f"test-users-{secrets.token_hex(4)}")
        try:
            asyncio.run(scenario(backend_for(launcher, tmp_path / "state", cgroups), image))
        finally:
            cgroups.remove_base()
