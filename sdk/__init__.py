"""Python SDK of the corral sandbox daemon.

    from corral.sdk import Client

    with Client() as client, client.create_sandbox(image="host") as sandbox:
        result = sandbox.exec(["echo", "hi"], timeout=10)
        print(result.exit_code, result.stdout)

`AsyncClient` / `AsyncSandbox` are the asyncio twins, with the same methods. Every failure is a
`CorralError` subclass; results are the frozen dataclasses in `corral.sdk.types`.
"""

from corral.sdk.client import AsyncClient, AsyncExecStream, AsyncSandbox
from corral.sdk.errors import (
    AlreadyExists,
    Cancelled,
    CommandExitError,
    CorralError,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    SandboxNotFound,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from corral.sdk.sync_client import Client, ExecStream, Sandbox
from corral.sdk.types import (
    BackendStatus,
    ExecEvent,
    ExecExited,
    ExecKeepalive,
    ExecOutput,
    ExecResult,
    ExecStarted,
    FileEntry,
    LimitStatus,
    NodeInfo,
    ResourceLimits,
    SandboxInfo,
)

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "AsyncExecStream",
    "AsyncSandbox",
    "BackendStatus",
    "Cancelled",
    "Client",
    "CommandExitError",
    "CorralError",
    "DeadlineExceeded",
    "ExecEvent",
    "ExecExited",
    "ExecKeepalive",
    "ExecOutput",
    "ExecResult",
    "ExecStarted",
    "ExecStream",
    "FailedPrecondition",
    "FileEntry",
    "Internal",
    "InvalidArgument",
    "LimitStatus",
    "NodeInfo",
    "NotFound",
    "PermissionDenied",
    "ProtocolError",
    "ResourceExhausted",
    "ResourceLimits",
    "Sandbox",
    "SandboxInfo",
    "SandboxNotFound",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
]
