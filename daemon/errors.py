"""Domain errors of the daemon and their one mapping to gRPC status codes.

Domain code raises these; `ErrorMappingInterceptor` turns them into status codes at the edge, so no
servicer needs its own try/except.
"""

from __future__ import annotations

import contextlib
import errno
import logging

import grpc

log = logging.getLogger(__name__)


class DaemonError(Exception):
    """An error whose message is meant for the caller."""

    code = grpc.StatusCode.INTERNAL


class NotFound(DaemonError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(DaemonError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(DaemonError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(DaemonError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(DaemonError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(DaemonError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(DaemonError):
    code = grpc.StatusCode.UNAVAILABLE


def from_os_error(err: OSError, path: str) -> DaemonError:
    """Maps a failed file operation inside a sandbox to the error its caller should see."""
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(f"{path}: {reason}")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{path}: {reason}")
    if err.errno in (errno.EXDEV, errno.ELOOP):
        return PermissionDenied(f"{path}: escapes the sandbox")
    if err.errno in (errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EINVAL):
        return InvalidArgument(f"{path}: {reason}")
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ResourceExhausted(f"{path}: {reason}")
    if err.errno in (errno.ENXIO, errno.ENODEV):  # a fifo without a reader, a device
        return InvalidArgument(f"{path}: not a regular file")
    if err.errno in (errno.ETXTBSY, errno.EBUSY):
        return FailedPrecondition(f"{path}: {reason}")
    return DaemonError(f"{path}: {reason}")


@contextlib.asynccontextmanager
async def map_errors(method: str, context: grpc.aio.ServicerContext):
    """Call guard: DaemonError becomes its status code; anything unexpected becomes INTERNAL."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # context.abort() already chose the status
    except DaemonError as err:
        await context.abort(err.code, str(err))
    except Exception as err:  # noqa: BLE001 - the caller gets a definite status, the log the trace
        log.exception("unexpected error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}")
