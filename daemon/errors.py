"""Where the daemon's errors meet the wire, and OS errors meet the error vocabulary.

The daemon raises the same exceptions the SDK raises (`corral.sdk.errors`: one class per status
code), so the daemon, the rollout engine and the SDK share one vocabulary. `map_errors`, a call
guard run around every handler, is the one place they become gRPC status codes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math

import grpc

from corral.sdk.errors import (
    RETRY_AFTER_MS_KEY,
    CorralError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)

log = logging.getLogger(__name__)


def from_os_error(err: OSError, path: str) -> CorralError:
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
    return Internal(f"{path}: {reason}")


@contextlib.asynccontextmanager
async def map_errors(method: str, context: grpc.aio.ServicerContext):
    """Call guard: a CorralError becomes its status code (INTERNAL for one without a code);
    anything unexpected becomes INTERNAL with its trace in the log."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # context.abort() already chose the status
    except CorralError as err:
        code = err.code or grpc.StatusCode.INTERNAL
        retry_after_s = getattr(err, "retry_after_s", None)
        if retry_after_s is not None:  # (ResourceExhausted from admission control)
            context.set_trailing_metadata(((RETRY_AFTER_MS_KEY, str(math.ceil(retry_after_s * 1000))),))
        if code == grpc.StatusCode.INTERNAL:
            # Not the caller's mistake: a bug, or an error without a status (a broken reply of
            # this daemon's own client, a protocol error); the log gets the trace.
            log.exception("internal error in %s", method)
        await context.abort(code, str(err))
    except Exception as err:
        log.exception("unexpected error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}")
