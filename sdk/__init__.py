"""Python SDK of the corral sandbox daemon.

    from corral.sdk import Client

    with Client() as client, client.create_sandbox(image="host") as sandbox:
        result = sandbox.exec(["echo", "hi"], timeout=10)
        print(result.exit_code, result.stdout)

Persistent shell sessions and IPython kernels:

    shell = sandbox.shell()    # the session "main": cwd and variables carry over between runs
    shell.run("cd /tmp && export X=1")
    print(shell.run("pwd; echo $X").text)
    kernel = sandbox.kernel()  # needs ipykernel in the sandbox's python
    print(kernel.execute("1 + 1").result_text)

`AsyncClient` / `AsyncSandbox` (`AsyncShell`, `AsyncKernel`) are the asyncio twins, with the same
methods. Every failure is a `CorralError` subclass; results are the frozen dataclasses in
`corral.sdk.types`.
"""

from corral.sdk.client import (
    AsyncClient,
    AsyncExecStream,
    AsyncKernel,
    AsyncKernelExecuteStream,
    AsyncSandbox,
    AsyncShell,
)
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
from corral.sdk.processes import AsyncProcess, AsyncTerminal, ExpectFailed, ProcessInfo, ProcessOutput
from corral.sdk.rollouts import AsyncRollouts, AsyncRolloutStream
from corral.sdk.sync_client import Client, ExecStream, Kernel, KernelExecuteStream, Sandbox, Shell
from corral.sdk.sync_processes import Process, Terminal
from corral.sdk.sync_rollouts import Rollouts, RolloutStream
from corral.sdk.tasks import load_tasks, task_from
from corral.sdk.types import (
    BackendStatus,
    DrainState,
    ExecEvent,
    ExecExited,
    ExecKeepalive,
    ExecOutput,
    ExecResult,
    ExecStarted,
    FileEntry,
    GatewayCounters,
    KernelDisplayEvent,
    KernelDoneEvent,
    KernelErrorEvent,
    KernelErrorInfo,
    KernelEvent,
    KernelInfo,
    KernelLateOutput,
    KernelResult,
    KernelResultEvent,
    KernelStreamEvent,
    LimitStatus,
    LLMServerInfo,
    Mount,
    NodeCapacity,
    NodeInfo,
    PoolInfo,
    ResourceLimits,
    RolloutResult,
    RolloutSample,
    RolloutStats,
    RolloutTurn,
    SandboxInfo,
    ShellInfo,
    ShellResult,
    SnapshotInfo,
    StageStats,
)

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "AsyncExecStream",
    "AsyncKernel",
    "AsyncKernelExecuteStream",
    "AsyncProcess",
    "AsyncRolloutStream",
    "AsyncRollouts",
    "AsyncSandbox",
    "AsyncShell",
    "AsyncTerminal",
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
    "ExpectFailed",
    "FailedPrecondition",
    "FileEntry",
    "Internal",
    "InvalidArgument",
    "Kernel",
    "KernelDisplayEvent",
    "KernelDoneEvent",
    "KernelErrorEvent",
    "KernelErrorInfo",
    "KernelEvent",
    "KernelExecuteStream",
    "KernelInfo",
    "KernelLateOutput",
    "KernelResult",
    "KernelResultEvent",
    "KernelStreamEvent",
    "GatewayCounters",
    "LLMServerInfo",
    "LimitStatus",
    "Mount",
    "DrainState",
    "NodeCapacity",
    "NodeInfo",
    "PoolInfo",
    "NotFound",
    "PermissionDenied",
    "Process",
    "ProcessInfo",
    "ProcessOutput",
    "ProtocolError",
    "ResourceExhausted",
    "ResourceLimits",
    "RolloutResult",
    "RolloutStats",
    "RolloutStream",
    "RolloutSample",
    "RolloutTurn",
    "Rollouts",
    "Sandbox",
    "SandboxInfo",
    "SnapshotInfo",
    "SandboxNotFound",
    "Shell",
    "ShellInfo",
    "ShellResult",
    "StageStats",
    "Terminal",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "load_tasks",
    "task_from",
]
