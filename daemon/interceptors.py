"""One server interceptor that runs call guards (async context managers) around every handler.

Auth, metrics and error mapping are each a guard; the interceptor knows the four handler shapes
so that no guard has to.
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from corral.sdk.errors import InvalidArgument, PermissionDenied

from .callers import NODE_RPCS, Caller, calling_as, node_refusal
from .metrics import Metrics

Guard = Callable[[str, grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]
CallerOf = Callable[[grpc.aio.ServicerContext], Caller]


class GuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, *guards: Guard) -> None:
        self.guards = guards
        self._wrapped: dict[str, object] = {}

    async def intercept_service(self, continuation, handler_call_details):
        # The registered handler of a method never changes, so it is wrapped once, not per call.
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            wrapped = self._wrapped[method] = self._wrap(handler, method.rsplit("/", 1)[-1])
        return wrapped

    def _wrap(self, handler, method: str):
        guards = self.guards

        async def enter(stack, context):
            for guard in guards:
                await stack.enter_async_context(guard(method, context))

        def unary_response(inner, streaming: bool):
            async def call(request, context):
                async with contextlib.AsyncExitStack() as stack:
                    await enter(stack, context)
                    return await inner(_checked_requests(request) if streaming else _checked(request), context)

            return call

        def stream_response(inner, streaming: bool):
            async def call(request, context):
                async with contextlib.AsyncExitStack() as stack:
                    await enter(stack, context)
                    async for item in inner(_checked_requests(request) if streaming else _checked(request), context):
                        yield item

            return call

        shapes = (
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler, unary_response, False),
            (handler.unary_stream, grpc.unary_stream_rpc_method_handler, stream_response, False),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler, unary_response, True),
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler, stream_response, True),
        )
        for inner, make, wrap, streaming in shapes:
            if inner:
                parse = _lenient(handler.request_deserializer)
                return make(wrap(inner, streaming), parse, handler.response_serializer)
        return handler


# A request that does not parse (a string field that is not UTF-8, a truncated message) is the
# caller's mistake: grpc would answer UNKNOWN from inside its deserializer, so the deserializer
# hands the error on instead, and the guarded handler raises INVALID_ARGUMENT.
@dataclass(frozen=True)
class _Malformed:
    error: str


def _lenient(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as err:
            return _Malformed(str(err))

    return parse


def _checked(request):
    if isinstance(request, _Malformed):
        raise InvalidArgument(f"malformed request: {request.error}")
    return request


async def _checked_requests(requests):
    async for request in requests:
        yield _checked(request)


def bearer_token(context: grpc.aio.ServicerContext) -> str:
    """The call's `authorization: Bearer <token>`'s token ("" without one)."""
    metadata = dict(context.invocation_metadata() or ())
    scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
    return token if scheme == "Bearer" else ""


def known_token(given: str, tokens: Collection[str]) -> str | None:
    """The token of `tokens` that `given` is, compared in constant time with every one."""
    found = None
    for token in tokens:
        if token and hmac.compare_digest(given.encode(), token.encode()):
            found = token
    return found


def bearer_token_guard(tokens: Collection[str]) -> Guard:
    """Calls over TCP must carry `authorization: Bearer <token>` with one of `tokens`; Unix-socket
    calls are trusted (the socket's file mode decides who may connect)."""

    @contextlib.asynccontextmanager
    async def guard(method: str, context: grpc.aio.ServicerContext):
        if not context.peer().startswith(("unix:", "unix-abstract:")):
            if known_token(bearer_token(context), tokens) is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        yield

    return guard


def caller_guard(caller_of: CallerOf, admin_group: str = "") -> Guard:
    """Serves each call as its caller (callers.py), which `caller_of` tells from the call; an
    error it raises is the call's answer (so this guard comes after map_errors). A call of one
    of NODE_RPCS by a caller who is not the node's operator is refused (PERMISSION_DENIED naming
    `admin_group`, daemon.admin_group)."""

    @contextlib.asynccontextmanager
    async def guard(method: str, context: grpc.aio.ServicerContext):
        caller = caller_of(context)
        if method in NODE_RPCS and not caller.may_change_node():
            raise PermissionDenied(node_refusal(method, admin_group))
        with calling_as(caller):
            yield

    return guard


def metrics_guard(metrics: Metrics) -> Guard:
    @contextlib.asynccontextmanager
    async def guard(method: str, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        code = "OK"
        try:
            yield
        except grpc.aio.AbortError:
            code = (context.code() or grpc.StatusCode.UNKNOWN).name
            raise
        except BaseException:
            code = "CANCELLED_OR_ERROR"
            raise
        finally:
            metrics.rpc_seconds.labels(method, code).observe(time.perf_counter() - start)

    return guard
