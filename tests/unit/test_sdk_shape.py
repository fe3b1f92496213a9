"""The sync and async SDK classes are twins (the sync ones generated from the async ones by
scripts/unasync.py): these tests check the public surface the generator and the transports must
keep identical, and the exports of corral.sdk."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

from corral.sdk import (
    AsyncClient,
    AsyncExecStream,
    AsyncKernel,
    AsyncKernelExecuteStream,
    AsyncSandbox,
    AsyncShell,
    Client,
    ExecStream,
    Kernel,
    KernelExecuteStream,
    Sandbox,
    Shell,
)
from corral.sdk.rollouts import AsyncRollouts, AsyncRolloutStream
from corral.sdk.sync_rollouts import Rollouts, RolloutStream

TWINS = [
    (Client, AsyncClient),
    (Sandbox, AsyncSandbox),
    (ExecStream, AsyncExecStream),
    (Shell, AsyncShell),
    (Kernel, AsyncKernel),
    (KernelExecuteStream, AsyncKernelExecuteStream),
    (Rollouts, AsyncRollouts),
    (RolloutStream, AsyncRolloutStream),
]
TWIN_IDS = [sync.__name__ for sync, _ in TWINS]

# Async methods that return a stream object instead of being awaited, and create_sandbox, which
# returns an AwaitableContext (awaitable, and usable in `async with` directly).
NOT_COROUTINES = {"create_sandbox", "exec_stream", "execute_stream", "keep_alive", "open_stream", "stream"}

# Protocol methods each side must have, sync name -> async name.
PROTOCOL_TWINS = {
    "__enter__": "__aenter__",
    "__exit__": "__aexit__",
    "__iter__": "__aiter__",
    "__next__": "__anext__",
}


def public_members(cls: type) -> dict[str, Any]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}


def normalised_signature(function: Callable[..., Any]) -> str:
    """The signature with the twin-specific "Async" prefixes and AwaitableContext wrappers (the
    blocking twin returns the thing itself) removed from annotations."""
    text = str(inspect.signature(function))
    text = re.sub(r"\bAwaitableContext\[([^\]]*)\]", r"\1", text)
    return re.sub(r"\bAsync(?=[A-Z])", "", text)


@pytest.mark.parametrize(("sync_class", "async_class"), TWINS, ids=TWIN_IDS)
def test_same_public_names(sync_class: type, async_class: type) -> None:
    assert sorted(public_members(sync_class)) == sorted(public_members(async_class))


@pytest.mark.parametrize(("sync_class", "async_class"), TWINS, ids=TWIN_IDS)
def test_same_signatures(sync_class: type, async_class: type) -> None:
    sync_members = public_members(sync_class)
    async_members = public_members(async_class)
    for name, sync_member in sync_members.items():
        async_member = async_members[name]
        assert type(sync_member) is type(async_member), name
        if isinstance(sync_member, property):
            continue
        assert normalised_signature(sync_member) == normalised_signature(async_member), name


@pytest.mark.parametrize(("sync_class", "async_class"), [(Client, AsyncClient)], ids=["Client"])
def test_same_constructor(sync_class: type, async_class: type) -> None:
    assert normalised_signature(inspect.getattr_static(sync_class, "__init__")) == normalised_signature(
        inspect.getattr_static(async_class, "__init__")
    )


@pytest.mark.parametrize(("sync_class", "async_class"), TWINS, ids=TWIN_IDS)
def test_async_methods_are_coroutines_and_sync_ones_are_not(sync_class: type, async_class: type) -> None:
    for name, member in public_members(async_class).items():
        if isinstance(member, property):
            continue
        assert inspect.iscoroutinefunction(member) == (name not in NOT_COROUTINES), name
    for name, member in public_members(sync_class).items():
        if not isinstance(member, property):
            assert not inspect.iscoroutinefunction(member), name


@pytest.mark.parametrize(("sync_class", "async_class"), TWINS, ids=TWIN_IDS)
def test_matching_protocols(sync_class: type, async_class: type) -> None:
    for sync_name, async_name in PROTOCOL_TWINS.items():
        assert hasattr(sync_class, sync_name) == hasattr(async_class, async_name), sync_name


def test_keyword_only_options_of_exec() -> None:
    """Only the command is positional, so options can be added later without breaking calls."""
    parameters = inspect.signature(Sandbox.exec).parameters
    positional = [
        name for name, parameter in parameters.items() if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert positional == ["self", "cmd"]


@pytest.mark.parametrize(
    ("method", "positional"),
    [
        (Shell.run, ["self", "cmd"]),
        (Kernel.execute, ["self", "code"]),
        (Kernel.execute_stream, ["self", "code"]),
        (Sandbox.shell, ["self", "name"]),
        (Sandbox.kernel, ["self"]),
    ],
    ids=["Shell.run", "Kernel.execute", "Kernel.execute_stream", "Sandbox.shell", "Sandbox.kernel"],
)
def test_keyword_only_options_of_shells_and_kernels(method: Callable[..., Any], positional: list[str]) -> None:
    parameters = inspect.signature(method).parameters
    assert [
        name for name, parameter in parameters.items() if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ] == positional
