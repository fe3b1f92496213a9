"""The exceptions the SDK raises: one root, one class per gRPC status code the daemon uses.

Every failure of a call reaches the caller as a `CorralError`; gRPC's own exception types never
escape. `asyncio.CancelledError` is not a failure of the call and is never converted.
"""

from __future__ import annotations

import grp
import os
import pwd
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from corral.sdk.types import ExecResult, ShellResult


class CorralError(Exception):
    """Root of every SDK exception.

    `code` is the gRPC status code the daemon answered with (None for errors found on this side of
    the wire), `details` the daemon's message saying what to fix.
    """

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, *, details: str | None = None, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.details = message if details is None else details
        if code is not None:
            self.code = code


class NotFound(CorralError):
    """NOT_FOUND: an unknown sandbox id, or a missing file inside a sandbox."""

    code = grpc.StatusCode.NOT_FOUND


# NOT_FOUND covers both unknown sandboxes and missing files, and the status code alone cannot tell
# them apart, so both names are the same class.
SandboxNotFound = NotFound


class InvalidArgument(CorralError):
    """INVALID_ARGUMENT: a malformed request (also raised before sending one the daemon would reject)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(CorralError):
    """FAILED_PRECONDITION: the node cannot do what was asked, e.g. no isolation is available."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(CorralError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(CorralError):
    """PERMISSION_DENIED: the sandbox user may not do that."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(CorralError):
    """UNAUTHENTICATED: a TCP listener wants the bearer token (pass `token=` or set CORRAL_TOKEN)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(CorralError):
    """RESOURCE_EXHAUSTED: a size cap or the sandbox count limit was reached.

    `retry_after_s` is the daemon's hint of when a retry may pass (its admission control:
    `[admission]`; sent as the `retry-after-ms` trailing metadata), None when it gave none.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(
        self,
        message: str,
        *,
        details: str | None = None,
        code: grpc.StatusCode | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, details=details, code=code)
        self.retry_after_s = retry_after_s


# The trailing metadata key that carries a RESOURCE_EXHAUSTED's retry hint, in milliseconds.
RETRY_AFTER_MS_KEY = "retry-after-ms"


class DeadlineExceeded(CorralError):
    """DEADLINE_EXCEEDED: the call's deadline passed before the daemon answered."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(CorralError):
    """UNAVAILABLE: the daemon cannot be reached, is shutting down, or its backend engine is down.

    `address` is the daemon address the call went to; `hint`, what to do about it when that is
    known (a socket this user may not connect to: socket_access_hint).
    """

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(
        self,
        message: str,
        *,
        details: str | None = None,
        code: grpc.StatusCode | None = None,
        address: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, details=details, code=code)
        self.address = address
        self.hint = hint


class Cancelled(CorralError):
    """CANCELLED: the call was cancelled (by the daemon, or by closing the client under it)."""

    code = grpc.StatusCode.CANCELLED


class Internal(CorralError):
    """INTERNAL: a bug in the daemon."""

    code = grpc.StatusCode.INTERNAL


class Unimplemented(CorralError):
    """UNIMPLEMENTED: the daemon is older than this SDK and lacks the RPC."""

    code = grpc.StatusCode.UNIMPLEMENTED


class ProtocolError(CorralError):
    """The daemon's answer broke the contract (e.g. a stream without its `exited` event, or an
    archive that is malformed or unsafe to unpack)."""


class CommandExitError(CorralError):
    """A command run with `check=True` exited non-zero, was killed or timed out.

    `result` is the full `ExecResult` (from `exec`) or `ShellResult` (from `Shell.run`), output
    included.
    """

    def __init__(self, result: ExecResult | ShellResult) -> None:
        super().__init__(_describe_failure(result))
        self.result = result


# Callers catch by class, so each code the daemon documents gets exactly one class. Codes not listed
# here (UNKNOWN, ABORTED, OUT_OF_RANGE, DATA_LOSS) become a plain CorralError carrying the code.
_ERROR_CLASS_BY_CODE: Mapping[grpc.StatusCode, type[CorralError]] = types.MappingProxyType(
    {
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
        grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
        grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
        grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
        grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
        grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
        grpc.StatusCode.CANCELLED: Cancelled,
        grpc.StatusCode.INTERNAL: Internal,
        grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    }
)


def error_class_for(code: grpc.StatusCode | None) -> type[CorralError]:
    """The exception class raised for a status code."""
    if code is None:
        return CorralError
    return _ERROR_CLASS_BY_CODE.get(code, CorralError)


def error_from_rpc(error: grpc.RpcError, *, address: str) -> CorralError:
    """Converts a failed gRPC call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`) to a CorralError.

    The caller raises the result `from error`, so the transport error stays in the traceback.
    """
    # A bare grpc.RpcError carries no status; the sync and aio call errors have code()/details().
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (error.details() if callable(getattr(error, "details", None)) else None) or str(error)
    error_class = error_class_for(code)
    if error_class is Unavailable:
        # "Nothing listens there" and the daemon's own UNAVAILABLE (shutting down, backend engine
        # down) share this code and cannot be told apart, so the wording fits both; naming the
        # address is what lets the reader spot a wrong socket path or a stopped daemon.
        hint = socket_access_hint(address) if "Permission denied" in details else None
        return Unavailable(
            f"the corral daemon at {address} is unavailable: {details}" + (f" ({hint})" if hint else ""),
            details=details,
            address=address,
            hint=hint,
        )
    if error_class is CorralError:
        return CorralError(f"{code.name}: {details}", details=details, code=code)
    if error_class is ResourceExhausted:
        return ResourceExhausted(details, details=details, retry_after_s=_retry_after_s(error))
    return error_class(details, details=details)


def socket_access_hint(address: str) -> str | None:
    """What a user refused by the daemon's socket (EACCES) can do: join the socket's group, named
    from the socket itself, or ask whoever runs the daemon; None for an address that is no Unix
    socket this process can see."""
    if not address.startswith("unix:"):
        return None
    path = address.removeprefix("unix://") if address.startswith("unix://") else address.removeprefix("unix:")
    try:
        info = os.stat(path)
    except OSError:
        return None
    if info.st_gid == 0:
        return (
            f"{path} admits only root: ask the node's admin to set daemon.socket_group (a group of users "
            "who may share the daemon) and add you to it"
        )
    try:
        group = grp.getgrgid(info.st_gid).gr_name
    except KeyError:
        group = str(info.st_gid)
    return (
        f"{path} admits the members of group {group!r}: ask the node's admin to add you "
        f"(usermod -aG {group} {_user_name()}), then log in again"
    )


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """The `retry-after-ms` trailing metadata of a failed call, in seconds (None: none, or not a
    number)."""
    trailing = error.trailing_metadata() if callable(getattr(error, "trailing_metadata", None)) else None
    for key, value in trailing or ():
        if key == RETRY_AFTER_MS_KEY:
            try:
                return max(int(value), 0) / 1000
            except (TypeError, ValueError):
                return None
    return None


class RpcErrorTranslator:
    """Context manager that re-raises a gRPC error inside it as the matching CorralError.

    One instance per client (it only holds the address), used around every call site of both the
    sync and the async client. Anything that is not a grpc.RpcError, asyncio.CancelledError
    included, passes through unchanged.
    """

    def __init__(self, address: str) -> None:
        self.address = address

    def __enter__(self) -> RpcErrorTranslator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: types.TracebackType | None
    ) -> None:
        if isinstance(exc, grpc.RpcError):
            raise error_from_rpc(exc, address=self.address) from exc


# Enough output to show the error a command printed last, short enough for a one-line message.
_STDERR_TAIL_BYTES = 500


def _describe_failure(result: ExecResult | ShellResult) -> str:
    # An ExecResult has stderr, signal and oom_killed; a ShellResult has one interleaved output
    # and says which of its limits expired.
    from corral.sdk.types import ShellResult  # here: corral.sdk.types imports this module

    if isinstance(result, ShellResult):
        exec_result = None
        label, tail_of = "output", result.output
        idle_timeout = result.timeout_reason == "idle_timeout"
    else:
        exec_result = result
        label, tail_of = "stderr", result.stderr
        idle_timeout = False
    if result.timed_out:
        if idle_timeout:
            what = f"was interrupted by its idle timeout after {result.duration_ms} ms"
        else:
            what = f"timed out after {result.duration_ms} ms"
    elif exec_result is not None and exec_result.oom_killed:
        what = f"was killed by the out-of-memory killer (exit code {result.exit_code})"
    elif result.disk_cap_killed:
        what = f"was killed for the sandbox's writes past its disk cap (exit code {result.exit_code})"
    elif exec_result is not None and exec_result.signal:
        what = f"was killed by signal {exec_result.signal}"
    else:
        what = f"exited with code {result.exit_code}"
    tail = tail_of[-_STDERR_TAIL_BYTES:].decode(errors="replace").strip()
    return f"command {what}" + (f"; {label}: {tail}" if tail else "")
