"""Fixtures of the unit tier: a daemon on the fake backend, in a thread of the test's process, for
behaviour that lives above the backends (modules that need a daemon of another kind define their
own `address` and `sandbox`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral.daemon.testing import fake_daemon_in_a_thread
from corral.sdk import Client, Sandbox


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """The address of a fake-backend daemon shared by the module's tests."""
    with fake_daemon_in_a_thread() as address:
        yield address


@pytest.fixture
def sandbox(address) -> Iterator[Sandbox]:
    """A sandbox of its own for the test, destroyed after it."""
    with Client(address) as client, client.create_sandbox() as sandbox:
        yield sandbox
