"""The blocking rollout API: `Client.rollouts` (`Rollouts`) and `RolloutStream`.

Twin of `rollouts.py` (asyncio); same methods and signatures, checked by tests/test_sdk_shape.py.

    with Client() as client:
        client.rollouts.register_llm("http://10.0.0.5:30000", protocol="sglang")
        for result in client.rollouts.stream(tasks, n=4):
            ...
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Union

from corral.sdk import rollout_messages as core
from corral.sdk._sync_transport import SyncTransport
from corral.sdk.tasks import TaskLike, task_from
from corral.sdk.types import LLMServerInfo, RolloutResult, RolloutStats, RolloutTurn
from corral.v1 import rollout_pb2 as pb

RolloutEvent = Union[RolloutResult, RolloutTurn]
TaskSource = Iterable[TaskLike]
_END_OF_INPUT = None


class Rollouts:
    """The daemon's RolloutService."""

    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport

    def register_llm(self, address: str, protocol: str = "sglang", *, weight: int = 1,
                     model: str = "") -> LLMServerInfo:
        """Adds an LLM server ("http://host:port") that rollouts generate from. `protocol`:
        "sglang" (native /generate) or "vllm" (OpenAI-compatible completions); `weight`: relative
        share of new rollouts; `model`: the model name vLLM is asked for (empty: the first it
        serves)."""
        request = core.build_register_llm_request(address, protocol, weight, model)
        response = self._transport.unary(self._transport.rollout_service.RegisterLLM, request)
        return core.llm_server_from_proto(response.server)

    def remove_llm(self, address: str) -> None:
        """Takes a server out (e.g. before a weight update); requests in flight finish."""
        self._transport.unary(self._transport.rollout_service.RemoveLLM, pb.RemoveLLMRequest(address=address))

    def list_llms(self) -> list[LLMServerInfo]:
        response = self._transport.unary(self._transport.rollout_service.ListLLMs, pb.ListLLMsRequest())
        return [core.llm_server_from_proto(server) for server in response.servers]

    def set_policy_version(self, version: int) -> int:
        """Tells the daemon the trainer's current policy version (staleness is measured against
        it). Versions only move forward."""
        response = self._transport.unary(self._transport.rollout_service.SetPolicyVersion,
                                         pb.SetPolicyVersionRequest(version=version))
        return response.version

    def stats(self) -> RolloutStats:
        response = self._transport.unary(self._transport.rollout_service.GetRolloutStats,
                                         pb.GetRolloutStatsRequest())
        return core.stats_from_proto(response)

    def run(self, task: TaskLike, *, max_staleness: int | None = None,
            timeout: float | None = None) -> RolloutResult:
        """Runs one rollout of `task` and returns its result. `timeout`: deadline of the whole
        rollout (None: none; cancelling the call cancels the rollout and frees its sandbox)."""
        request = core.build_run_request(task, max_staleness)
        with self._transport.translate:
            response = self._transport.rollout_service.Run(request, timeout=timeout, metadata=self._transport.metadata)
        return core.result_from_proto(response.result)

    def open_stream(self) -> RolloutStream:
        """A stream to submit tasks to and read results from as they finish (see RolloutStream):
        `with client.rollouts.open_stream() as s:`."""
        return RolloutStream(self._transport)

    def stream(self, tasks: TaskSource, *, n: int = 1, max_staleness: int | None = None,
               turns: bool = False) -> Iterator[RolloutEvent]:
        """Submits every task (`n` samples each) and yields each RolloutResult as it finishes, in
        completion order (with `turns`, also each RolloutTurn as it completes). Leaving the loop
        early cancels what is unfinished."""
        tasks = [task_from(task) for task in tasks]  # a malformed task fails before anything runs
        with self.open_stream() as stream:
            for task in tasks:
                stream.submit(task, n=n, max_staleness=max_staleness, turns=turns)
            stream.close_input()
            yield from stream


class RolloutStream:
    """One RolloutService.Stream call. `submit` tasks and `cancel` them at any time; iterate to get
    RolloutResult (and, for submissions with `turns`, RolloutTurn) events in completion order.
    After `close_input()` the iteration ends once every submitted rollout has its result. A
    submission the daemon rejects raises its error (e.g. InvalidArgument) from the iteration.
    Leaving `with` (or `close()`) cancels every unfinished rollout of the stream."""

    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport
        # grpc sends the requests from its own thread, taking them from this queue as the daemon
        # reads them.
        self._requests: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._input_closed = False
        self._closed = False
        self._submitted = 0
        with self._transport.translate:
            self._call = transport.rollout_service.Stream(self._request_iterator(), metadata=transport.metadata)

    def _request_iterator(self) -> Iterator[pb.StreamRequest]:
        while (request := self._requests.get()) is not _END_OF_INPUT:
            yield request

    def submit(self, task: TaskLike, *, n: int = 1, max_staleness: int | None = None,
               turns: bool = False, group_id: str | None = None) -> None:
        """Queues `n` rollouts of a task."""
        options = core.build_options(n=n, max_staleness=max_staleness, stream_turns=turns, group_id=group_id)
        with self._lock:
            request = core.build_submit(task, options, client_ref=str(self._submitted))
            self._submitted += 1
            self._put(request)

    def cancel(self, *, task_id: str | None = None, rollout_id: str | None = None) -> None:
        """Cancels the unfinished rollouts of a task, or one rollout; their results come back with
        status "cancelled"."""
        self._put(core.build_cancel(task_id=task_id, rollout_id=rollout_id))

    def close_input(self) -> None:
        """No more submissions: the iteration ends after the last result."""
        if not self._input_closed:
            self._input_closed = True
            self._requests.put(_END_OF_INPUT)

    def _put(self, request: pb.StreamRequest) -> None:
        if self._input_closed:
            raise core.InvalidArgument("this stream's input is closed")
        self._requests.put(request)

    def __iter__(self) -> Iterator[RolloutEvent]:
        return self

    def __next__(self) -> RolloutEvent:
        while not self._closed:
            with self._transport.translate:
                response = next(self._call, None)
            if response is None:
                self._closed = True
                break
            kind = response.WhichOneof("event")
            if kind == "result":
                return core.result_from_proto(response.result)
            if kind == "turn":
                return core.turn_from_proto(response.turn)
            if kind == "rejected":
                raise core.rejection_error(response.rejected)
        raise StopIteration

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call.cancel()
        self.close_input()

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
