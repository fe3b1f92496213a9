"""The fixtures of SWE-ReX's own tests/conftest.py, on corral: SWE-ReX's test modules run unchanged
with this as their conftest.

SWE-ReX's source distribution ships its test modules without their conftest.py (which starts its
server on a LocalRuntime in a thread). tests/integration/test_swerex.py builds a package `tests`
in a temporary directory: links to SWE-ReX's modules and a conftest.py that star-imports this
module, so that `from .conftest import _Action` and `from tests.conftest import RemoteServer` in
them find these names. `remote_server` is `corral swerex-serve` (a CorralRuntime on a sandbox of
CORRAL_SWEREX_BACKEND / CORRAL_SWEREX_IMAGE at CORRAL_ADDRESS); with CORRAL_SWEREX_VIA=corral,
`remote_runtime` is a CorralRuntime called directly (on one sandbox of its own for the run, as the
server has one) instead of SWE-ReX's RemoteRuntime talking to that server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
)
from swerex.runtime.remote import RemoteRuntime

from corral.integrations.swerex import CorralRuntime
from corral.sdk import AsyncClient, Client

TEST_API_KEY = "corral-swerex-test-key"


@dataclass
class RemoteServer:
    port: int
    headers: dict[str, str] = field(default_factory=lambda: {"X-API-Key": TEST_API_KEY})


def _sandbox_options() -> dict[str, Any]:
    return {"backend": os.environ["CORRAL_SWEREX_BACKEND"], "image": os.environ["CORRAL_SWEREX_IMAGE"]}


@pytest.fixture(scope="session")
def remote_server() -> Iterator[RemoteServer]:
    options = _sandbox_options()
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.cli", "swerex-serve", "--port", "0", "--auth-token", TEST_API_KEY]
        + ["--backend", options["backend"], "--image", options["image"]],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    found = re.search(r"on http://[^:]+:(\d+)", proc.stdout.readline())
    if found is None:
        proc.kill()
        pytest.fail(f"corral swerex-serve did not start (exit {proc.wait()})")
    yield RemoteServer(int(found.group(1)))
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="session")
def corral_sandbox_id() -> Iterator[str]:
    """One sandbox for the whole run, as the server has (each test gets a runtime of its own)."""
    with Client() as client, client.create_sandbox(**_sandbox_options(), idle_timeout=600) as sandbox:
        yield sandbox.id


@pytest.fixture
async def remote_runtime(request: pytest.FixtureRequest) -> AsyncIterator[AbstractRuntime]:
    if os.environ.get("CORRAL_SWEREX_VIA") == "corral":
        client = AsyncClient()
        direct = CorralRuntime(await client.get_sandbox(request.getfixturevalue("corral_sandbox_id")))
        yield direct
        await direct.close()
        await client.close()
        return
    server = request.getfixturevalue("remote_server")
    remote = RemoteRuntime(host="http://127.0.0.1", port=server.port, auth_token=TEST_API_KEY, timeout=10)
    yield remote
    await remote.close()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: AbstractRuntime) -> AsyncIterator[AbstractRuntime]:
    await remote_runtime.create_session(CreateBashSessionRequest())
    yield remote_runtime
    await remote_runtime.close_session(CloseBashSessionRequest())


class _Action(BashAction):
    """SWE-ReX's test BashAction: a 5-second timeout unless the test gives one."""

    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5


__all__ = [
    "TEST_API_KEY",
    "RemoteServer",
    "_Action",
    "_Command",
    "corral_sandbox_id",
    "remote_runtime",
    "remote_server",
    "runtime_with_default_session",
]
