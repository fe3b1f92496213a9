"""The grpc.aio channel under `AsyncClient` and `AsyncSandbox`: makes calls with the client's metadata
and deadlines, and turns every gRPC error into a CorralError. The blocking twin is `_sync_transport`,
with the same methods; everything that differs between asyncio and threads (calls, streams, blocking
work, a background task) lives in the two transports, so that the clients above them are written
once (client.py, rollouts.py) and the blocking ones generated (scripts/unasync.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from types import TracebackType
from typing import Any, Final, Generic, Literal, Protocol, TypeVar

import grpc

from corral.sdk._address import DaemonAddress, auth_metadata, channel_options
from corral.sdk._core import call_deadline, grpc_timeout
from corral.sdk.errors import FailedPrecondition, RpcErrorTranslator
from corral.v1 import kernel_pb2_grpc, rollout_pb2_grpc, sandbox_pb2_grpc, shell_pb2_grpc

ResponseT = TypeVar("ResponseT")
ResultT = TypeVar("ResultT")
ItemT = TypeVar("ItemT")


class _AsyncContextManager(Protocol):
    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> Any: ...


ContextT = TypeVar("ContextT", bound=_AsyncContextManager)


class AsyncTransport:
    def __init__(self, address: DaemonAddress, token: str | None, default_timeout: float) -> None:
        self.address = address
        self.default_timeout = call_deadline(None, default_timeout)  # rejects a non-positive default
        self._metadata = auth_metadata(token)
        self._translate = RpcErrorTranslator(str(address))
        # A grpc.aio channel belongs to the event loop it is created in, and a client is often
        # constructed before any loop runs, or used from several (asyncio.run() per operation, a
        # loop per thread), so each loop gets its own channel, opened by its first call there.
        self._channels: dict[asyncio.AbstractEventLoop, _LoopChannel] = {}
        self._lock = threading.Lock()  # loops in other threads open channels too
        self._closed = False

    @property
    def sandbox_service(self) -> sandbox_pb2_grpc.SandboxServiceStub:
        """The SandboxService stub of the running loop's channel (every service's stub of a loop
        shares its channel)."""
        return self._current().sandbox_service

    @property
    def shell_service(self) -> shell_pb2_grpc.ShellServiceStub:
        return self._current().shell_service

    @property
    def kernel_service(self) -> kernel_pb2_grpc.KernelServiceStub:
        return self._current().kernel_service

    @property
    def rollout_service(self) -> rollout_pb2_grpc.RolloutServiceStub:
        return self._current().rollout_service

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (the bearer token) for calls made outside `unary`/`server_stream`."""
        return self._metadata

    @property
    def translate(self) -> RpcErrorTranslator:
        """Context manager turning gRPC errors into CorralErrors, for calls driven by their caller."""
        return self._translate

    def bidi_stream(self, method: Callable[..., Any]) -> AsyncBidiCall:
        """A bidirectional call without a deadline (it lasts as long as its caller keeps it)."""
        with self._translate:
            return AsyncBidiCall(method(metadata=self._metadata), self._translate)

    async def unary(self, method: Callable[..., Any], request: Any, *, timeout: float | None = None) -> Any:
        with self._translate:
            return await method(request, timeout=self._deadline(timeout), metadata=self._metadata)

    def server_stream(
        self, method: Callable[..., Any], request: Any, *, timeout: float | None = None
    ) -> AsyncResponseStream[Any]:
        with self._translate:
            call = method(request, timeout=self._deadline(timeout), metadata=self._metadata)
        return AsyncResponseStream(call, self._translate)

    async def client_stream(
        self, method: Callable[..., Any], requests: Iterator[Any], *, timeout: float | None = None
    ) -> Any:
        """Sends `requests` (a blocking iterator, e.g. one reading local files: it is iterated off
        the event loop) and returns the reply."""
        with self._translate:
            call = method(timeout=self._deadline(timeout), metadata=self._metadata)
            try:
                try:
                    async for request in _iterate_in_thread(requests):
                        await call.write(request)
                    await call.done_writing()
                except asyncio.InvalidStateError:
                    pass  # the daemon already ended the call; awaiting it raises its status
                return await call
            finally:
                # No effect on a call that ended; aborts the upload when producing a request
                # failed or the task was cancelled, so the daemon never unpacks a partial archive.
                call.cancel()

    async def run_plan(self, method: Callable[..., Any], plan: Generator[Any, Any, ResultT]) -> ResultT:
        """Drives a request plan from `_core` (e.g. `read_file_plan`): sends each request it yields,
        feeds the reply back, and returns what the plan returns."""
        try:
            request = next(plan)
            while True:
                request = plan.send(await self.unary(method, request))
        except StopIteration as finished:
            return finished.value

    @staticmethod
    async def offload(fn: Callable[..., ResultT], *args: Any) -> ResultT:
        """Runs blocking work (local files) off the event loop."""
        return await asyncio.to_thread(fn, *args)

    @staticmethod
    def background(work: Callable[[], Coroutine[Any, Any, None]]) -> AsyncBackground:
        """Starts `work()` concurrently with the caller (a task)."""
        return AsyncBackground(asyncio.create_task(work()))

    @staticmethod
    def periodic(work: Callable[[], Coroutine[Any, Any, None]], interval_s: float) -> AsyncBackground:
        """Runs `work()` every `interval_s` seconds beside the caller until cancelled (a task)."""

        async def repeat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                await work()

        return AsyncBackground(asyncio.create_task(repeat()))

    async def close(self) -> None:
        """Closes every channel: the running loop's is closed here (its calls are cancelled); one
        of a loop running in another thread is closed there; one of a loop that is closed, or
        not running, is dropped (grpc closes it when it is collected)."""
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
        current = asyncio.get_running_loop()
        for loop, channel in channels.items():
            if loop is current:
                await channel.channel.close()
            elif loop.is_running() and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # it closed meanwhile
                    asyncio.run_coroutine_threadsafe(channel.channel.close(), loop)

    def _deadline(self, timeout: float | None) -> float | None:
        return grpc_timeout(timeout, self.default_timeout)

    def _current(self) -> _LoopChannel:
        """The running loop's channel, opened on first use. Channels of loops that have been
        closed since (e.g. by asyncio.run) are dropped then: nothing can use them any more."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise FailedPrecondition("this corral client is closed")
            channel = self._channels.get(loop)
            if channel is None:
                for old in [old for old in self._channels if old.is_closed()]:
                    del self._channels[old]
                channel = self._channels[loop] = _LoopChannel(self.address)
            return channel


class _LoopChannel:
    """One event loop's grpc.aio channel and the stubs of every service on it."""

    def __init__(self, address: DaemonAddress) -> None:
        self.channel = grpc.aio.insecure_channel(address.grpc_target, options=channel_options())
        self.sandbox_service = sandbox_pb2_grpc.SandboxServiceStub(self.channel)
        self.shell_service = shell_pb2_grpc.ShellServiceStub(self.channel)
        self.kernel_service = kernel_pb2_grpc.KernelServiceStub(self.channel)
        self.rollout_service = rollout_pb2_grpc.RolloutServiceStub(self.channel)


class _Finished(enum.Enum):
    FINISHED = enum.auto()


_FINISHED: Final = _Finished.FINISHED


def _next_item(items: Iterator[ItemT]) -> ItemT | Literal[_Finished.FINISHED]:
    return next(items, _FINISHED)


async def _iterate_in_thread(items: Iterator[ItemT]) -> AsyncIterator[ItemT]:
    """Iterates a blocking iterator (e.g. one reading local files) off the event loop, one item
    per worker-thread hop."""
    while (item := await asyncio.to_thread(_next_item, items)) is not _FINISHED:
        yield item


class AsyncResponseStream(Generic[ResponseT]):
    """The responses of a server-streaming call, with gRPC errors translated. `close()` cancels the
    call (for ExecStream this kills the command)."""

    def __init__(self, call: Any, translate: RpcErrorTranslator) -> None:
        self._call = call
        self._translate = translate
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> AsyncResponseStream[ResponseT]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[ResponseT]:
        return self

    async def __anext__(self) -> ResponseT:
        # After cancel(), grpc.aio answers read() with CancelledError; a closed stream just ends.
        if self._closed:
            raise StopAsyncIteration
        with self._translate:
            response = await self._call.read()
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return response

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call.cancel()  # no effect on a call that already ended


class AsyncBidiCall:
    """A bidirectional call: write requests, read responses (None once the call ended OK), cancel.
    gRPC errors are translated."""

    def __init__(self, call: Any, translate: RpcErrorTranslator) -> None:
        self._call = call
        self._translate = translate

    async def write(self, request: Any) -> None:
        """Sends one request; waits while the daemon is not reading (flow control)."""
        with self._translate:
            await self._call.write(request)

    async def done_writing(self) -> None:
        with self._translate:
            await self._call.done_writing()

    async def read(self) -> Any:
        """The next response, or None once the call ended OK (a failed call raises)."""
        with self._translate:
            response = await self._call.read()
        return None if response is grpc.aio.EOF else response

    def cancel(self) -> None:
        self._call.cancel()  # no effect on a call that already ended


class AwaitableContext(Coroutine[Any, Any, ContextT]):
    """What a call that makes something to clean up returns (`AsyncClient.create_sandbox`), as
    aiohttp's `session.get()` does: `await` it for the thing, or use it directly in `async with`,
    which awaits it, then enters the thing and leaves it (destroying a sandbox) at the end.

    It is a coroutine too, so `asyncio.create_task` and `asyncio.gather` take it. The blocking
    client has no counterpart: its call returns the thing itself (scripts/unasync.py unwraps it).
    """

    def __init__(self, coroutine: Coroutine[Any, Any, ContextT]) -> None:
        self._coroutine = coroutine
        self._value: ContextT | None = None

    def __await__(self) -> Generator[Any, None, ContextT]:
        return self._coroutine.__await__()

    def send(self, value: Any) -> Any:
        return self._coroutine.send(value)

    def throw(self, *args: Any) -> Any:
        return self._coroutine.throw(*args)

    def close(self) -> None:
        self._coroutine.close()

    async def __aenter__(self) -> ContextT:
        self._value = await self._coroutine
        return await self._value.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> Any:
        assert self._value is not None  # __aenter__ returned
        return await self._value.__aexit__(exc_type, exc, traceback)


class AsyncBackground:
    """Work running beside its starter (see AsyncTransport.background)."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task

    async def wait(self) -> None:
        """Waits for the work to end and raises what it raised."""
        await self._task

    def cancel(self) -> None:
        self._task.cancel()
