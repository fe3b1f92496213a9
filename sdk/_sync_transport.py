"""The blocking gRPC channel under `Client` and `Sandbox`: makes calls with the client's metadata and
deadlines, and turns every gRPC error into a CorralError. The async twin is `_async_transport`, with
the same methods (see there why the differences live in the transports)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, Generic, TypeVar

import grpc

from corral.sdk._address import DaemonAddress, auth_metadata, channel_options
from corral.sdk._core import call_deadline, grpc_timeout
from corral.sdk.errors import FailedPrecondition, InvalidArgument, RpcErrorTranslator
from corral.v1 import kernel_pb2_grpc, rollout_pb2_grpc, sandbox_pb2_grpc, shell_pb2_grpc

ResponseT = TypeVar("ResponseT")
ResultT = TypeVar("ResultT")


class SyncTransport:
    def __init__(self, address: DaemonAddress, token: str | None, default_timeout: float) -> None:
        self.address = address
        self.default_timeout = call_deadline(None, default_timeout)  # rejects a non-positive default
        self._metadata = auth_metadata(token)
        self._translate = RpcErrorTranslator(str(address))
        self._channel = grpc.insecure_channel(address.grpc_target, options=channel_options())
        self._closed = False
        # Every service's stub shares the one channel.
        self.sandbox_service = sandbox_pb2_grpc.SandboxServiceStub(self._channel)
        self.shell_service = shell_pb2_grpc.ShellServiceStub(self._channel)
        self.kernel_service = kernel_pb2_grpc.KernelServiceStub(self._channel)
        self.rollout_service = rollout_pb2_grpc.RolloutServiceStub(self._channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (the bearer token) for calls made outside `unary`/`server_stream`."""
        return self._metadata

    @property
    def translate(self) -> RpcErrorTranslator:
        """Context manager turning gRPC errors into CorralErrors, for calls driven by their caller."""
        return self._translate

    def unary(self, method: Callable[..., ResponseT], request: Any, *, timeout: float | None = None) -> ResponseT:
        self._ensure_open()
        with self._translate:
            return method(request, timeout=self._deadline(timeout), metadata=self._metadata)

    def server_stream(
        self, method: Callable[..., Any], request: Any, *, timeout: float | None = None
    ) -> ResponseStream[Any]:
        self._ensure_open()
        with self._translate:
            call = method(request, timeout=self._deadline(timeout), metadata=self._metadata)
        return ResponseStream(call, self._translate)

    def client_stream(
        self, method: Callable[..., ResponseT], requests: Iterable[Any], *, timeout: float | None = None
    ) -> ResponseT:
        self._ensure_open()
        producer = _RecordingRequests(requests)
        with self._translate:
            try:
                return method(iter(producer), timeout=self._deadline(timeout), metadata=self._metadata)
            except grpc.RpcError:
                # grpc iterates the requests on its own thread and reports a failure there only
                # as a cancelled call; the original error (e.g. a local file that vanished) is
                # the one worth raising.
                producer.reraise_failure()
                raise

    def bidi_stream(self, method: Callable[..., Any]) -> SyncBidiCall:
        """A bidirectional call without a deadline (it lasts as long as its caller keeps it)."""
        self._ensure_open()
        return SyncBidiCall(method, self._metadata, self._translate)

    @staticmethod
    def offload(fn: Callable[..., ResultT], *args: Any) -> ResultT:
        """Runs blocking work; in the blocking client, right here."""
        return fn(*args)

    @staticmethod
    def background(work: Callable[[], None]) -> SyncBackground:
        """Starts `work()` concurrently with the caller (a thread)."""
        return SyncBackground(work)

    @staticmethod
    def periodic(work: Callable[[], None], interval_s: float) -> SyncPeriodic:
        """Runs `work()` every `interval_s` seconds beside the caller until cancelled (a thread)."""
        return SyncPeriodic(work, interval_s)

    def interactive_stream(self, method: Callable[..., Any], requests: Iterable[Any]) -> ResponseStream[Any]:
        """A bidirectional call without a deadline, for an interactive terminal that lasts as long
        as its user: grpc sends `requests` from its own thread, the replies are iterated here, and
        `close()` cancels the call."""
        self._ensure_open()
        with self._translate:
            call = method(iter(requests), metadata=self._metadata)
        return ResponseStream(call, self._translate)

    def run_plan(self, method: Callable[..., Any], plan: Generator[Any, Any, ResultT]) -> ResultT:
        """Drives a request plan from `_core` (e.g. `read_file_plan`): sends each request it yields,
        feeds the reply back, and returns what the plan returns."""
        try:
            request = next(plan)
            while True:
                request = plan.send(self.unary(method, request))
        except StopIteration as finished:
            return finished.value

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return grpc_timeout(timeout, self.default_timeout)

    def _ensure_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("this corral client is closed")


class ResponseStream(Generic[ResponseT]):
    """The responses of a server-streaming call, with gRPC errors translated. `close()` cancels the
    call (for ExecStream this kills the command)."""

    def __init__(self, call: Any, translate: RpcErrorTranslator) -> None:
        self._call = call
        self._translate = translate
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ResponseStream[ResponseT]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[ResponseT]:
        return self

    def __next__(self) -> ResponseT:
        if self._closed:
            raise StopIteration
        with self._translate:
            return next(self._call)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call.cancel()  # no effect on a call that already ended


class _RecordingRequests:
    """Iterates requests for grpc's sending thread and remembers the exception that stopped it."""

    def __init__(self, requests: Iterable[Any]) -> None:
        self._requests = requests
        self._failure: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._requests
        except BaseException as failure:
            self._failure = failure
            raise

    def reraise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


_END_OF_REQUESTS = object()


class SyncBidiCall:
    """A bidirectional call: write requests, read responses (None once the call ended OK), cancel.
    gRPC errors are translated. grpc sends the requests from its own thread, taking them from a
    queue as the daemon reads them, so `write` never blocks."""

    def __init__(
        self, method: Callable[..., Any], metadata: tuple[tuple[str, str], ...], translate: RpcErrorTranslator
    ) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._translate = translate
        self._writing = True
        self._lock = threading.Lock()
        with self._translate:
            self._call = method(self._request_iterator(), metadata=metadata)

    def _request_iterator(self) -> Iterator[Any]:
        while (request := self._requests.get()) is not _END_OF_REQUESTS:
            yield request

    def write(self, request: Any) -> None:
        with self._lock:
            if not self._writing:
                raise InvalidArgument("this call takes no more requests")
            self._requests.put(request)

    def done_writing(self) -> None:
        with self._lock:
            if self._writing:
                self._writing = False
                self._requests.put(_END_OF_REQUESTS)

    def read(self) -> Any:
        """The next response, or None once the call ended OK (a failed call raises)."""
        with self._translate:
            return next(self._call, None)

    def cancel(self) -> None:
        self._call.cancel()  # no effect on a call that already ended
        self.done_writing()  # frees grpc's sending thread


class SyncBackground:
    """Work running beside its starter, in a thread (see SyncTransport.background). A thread
    cannot be interrupted, so `cancel` does nothing: the work must end by itself (a rollout
    stream's submitter does once the stream is closed, as its next submission then fails)."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="corral-background", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as failure:  # noqa: BLE001 - handed to wait()
            self._failure = failure

    def wait(self) -> None:
        """Waits for the work to end and raises what it raised."""
        self._thread.join()
        if self._failure is not None:
            raise self._failure

    def cancel(self) -> None:
        pass


class SyncPeriodic:
    """Work repeated in a thread (see SyncTransport.periodic); `cancel` stops it between two runs
    and waits for a run under way."""

    def __init__(self, work: Callable[[], None], interval_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work, interval_s), name="corral-periodic", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None], interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            work()

    def cancel(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
