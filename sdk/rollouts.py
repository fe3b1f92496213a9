"""The asyncio rollout API: `AsyncClient.rollouts` (`AsyncRollouts`) and `AsyncRolloutStream`.

A trainer registers its LLM servers, then either runs one task (`run`) or streams many (`stream`),
getting each result as soon as it finishes:

    async with AsyncClient() as client:
        await client.rollouts.register_llm("http://10.0.0.5:30000", protocol="sglang")
        async for result in client.rollouts.stream(tasks, n=4):
            ...

`sync_rollouts.py` is generated from this file by scripts/unasync.py (`make sync-client`).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from types import TracebackType
from typing import Literal, overload

from corral.sdk import rollout_messages as core
from corral.sdk._async_transport import AsyncTransport
from corral.sdk.errors import InvalidArgument
from corral.sdk.tasks import TaskLike, task_from
from corral.sdk.types import LLMServerInfo, RolloutResult, RolloutStats, RolloutTurn
from corral.v1 import rollout_pb2 as pb

RolloutEvent = RolloutResult | RolloutTurn
# What `stream` takes: tasks from an iterable (in the asyncio client, an async iterable too).
TaskSource = Iterable[TaskLike] | AsyncIterable[TaskLike]


class AsyncRollouts:
    """The daemon's RolloutService."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def register_llm(
        self, address: str, protocol: str = "sglang", *, weight: int = 1, model: str = ""
    ) -> LLMServerInfo:
        """Adds an LLM server ("http://host:port") that rollouts generate from. `protocol`:
        "sglang" (native /generate) or "vllm" (OpenAI-compatible completions); `weight`: relative
        share of new rollouts; `model`: the model name vLLM is asked for (empty: the first it
        serves)."""
        request = core.build_register_llm_request(address, protocol, weight, model)
        response = await self._transport.unary(self._transport.rollout_service.RegisterLLM, request)
        return core.llm_server_from_proto(response.server)

    async def remove_llm(self, address: str) -> None:
        """Takes a server out (e.g. before a weight update); requests in flight finish."""
        await self._transport.unary(self._transport.rollout_service.RemoveLLM, pb.RemoveLLMRequest(address=address))

    async def list_llms(self) -> list[LLMServerInfo]:
        response = await self._transport.unary(self._transport.rollout_service.ListLLMs, pb.ListLLMsRequest())
        return [core.llm_server_from_proto(server) for server in response.servers]

    async def set_policy_version(self, version: int) -> int:
        """Tells the daemon the trainer's current policy version (staleness is measured against
        it). Versions only move forward."""
        response = await self._transport.unary(
            self._transport.rollout_service.SetPolicyVersion, pb.SetPolicyVersionRequest(version=version)
        )
        return response.version

    async def stats(self) -> RolloutStats:
        response = await self._transport.unary(
            self._transport.rollout_service.GetRolloutStats, pb.GetRolloutStatsRequest()
        )
        return core.stats_from_proto(response)

    async def run(
        self, task: TaskLike, *, max_staleness: int | None = None, timeout: float | None = None
    ) -> RolloutResult:
        """Runs one rollout of `task` and returns its result. `timeout`: deadline of the whole
        rollout (None: none; cancelling the call cancels the rollout and frees its sandbox)."""
        request = core.build_run_request(task, max_staleness)
        with self._transport.translate:
            response = await self._transport.rollout_service.Run(
                request, timeout=timeout, metadata=self._transport.metadata
            )
        return core.result_from_proto(response.result)

    def open_stream(self) -> AsyncRolloutStream:
        """A stream to submit tasks to and read results from as they finish (see
        AsyncRolloutStream). Use: `async with client.rollouts.open_stream() as s: ...`."""
        return AsyncRolloutStream(self._transport)

    @overload
    def stream(
        self, tasks: TaskSource, *, n: int = ..., max_staleness: int | None = ..., turns: Literal[False] = ...
    ) -> AsyncIterator[RolloutResult]: ...

    @overload
    def stream(
        self, tasks: TaskSource, *, n: int = ..., max_staleness: int | None = ..., turns: bool
    ) -> AsyncIterator[RolloutEvent]: ...

    async def stream(
        self, tasks: TaskSource, *, n: int = 1, max_staleness: int | None = None, turns: bool = False
    ) -> AsyncIterator[RolloutEvent]:
        """Submits every task (`n` samples each) and yields each RolloutResult as it finishes, in
        completion order (with `turns`, also each RolloutTurn as it completes). Submitting goes on
        in the background while results arrive. Leaving the loop early cancels what is unfinished."""
        if isinstance(tasks, Iterable):
            tasks = [task_from(task) for task in tasks]  # a malformed task fails before anything runs
        async with self.open_stream() as stream:

            async def submit_all() -> None:
                try:
                    async for task in _each(tasks):
                        await stream.submit(task, n=n, max_staleness=max_staleness, turns=turns)
                finally:
                    # Also after a failure: the stream then ends once what was accepted is done,
                    # and the failure is raised below.
                    await stream.close_input()

            submitter = self._transport.background(submit_all)
            try:
                async for event in stream:
                    yield event
                await submitter.wait()
            finally:
                submitter.cancel()


async def _each(tasks: TaskSource) -> AsyncIterator[TaskLike]:
    """The tasks of an iterable or of an async iterable, one by one."""
    if isinstance(tasks, AsyncIterable):
        async for task in tasks:
            yield task
    else:
        for task in tasks:
            yield task


class AsyncRolloutStream:
    """One RolloutService.Stream call. `submit` tasks and `cancel` them at any time; iterate to get
    RolloutResult (and, for submissions with `turns`, RolloutTurn) events in completion order.
    After `close_input()` the iteration ends once every submitted rollout has its result. A
    submission the daemon rejects raises its error (e.g. InvalidArgument) from the iteration.
    Leaving `async with` (or `close()`) cancels every unfinished rollout of the stream."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport
        self._call = transport.bidi_stream(transport.rollout_service.Stream)
        self._closed = False
        self._input_closed = False
        self._client_refs = itertools.count()

    async def submit(
        self,
        task: TaskLike,
        *,
        n: int = 1,
        max_staleness: int | None = None,
        turns: bool = False,
        group_id: str | None = None,
    ) -> None:
        """Queues `n` rollouts of a task (in the asyncio client, waiting while the daemon's queues
        are full)."""
        options = core.build_options(n=n, max_staleness=max_staleness, stream_turns=turns, group_id=group_id)
        self._check_input_open()
        await self._call.write(core.build_submit(task, options, client_ref=str(next(self._client_refs))))

    async def cancel(self, *, task_id: str | None = None, rollout_id: str | None = None) -> None:
        """Cancels the unfinished rollouts of a task, or one rollout; their results come back with
        status "cancelled"."""
        self._check_input_open()
        await self._call.write(core.build_cancel(task_id=task_id, rollout_id=rollout_id))

    async def close_input(self) -> None:
        """No more submissions: the iteration ends after the last result."""
        if not self._input_closed:
            self._input_closed = True
            await self._call.done_writing()

    def _check_input_open(self) -> None:
        if self._input_closed:
            raise InvalidArgument("this stream's input is closed")

    def __aiter__(self) -> AsyncIterator[RolloutEvent]:
        return self

    async def __anext__(self) -> RolloutEvent:
        while not self._closed:
            response = await self._call.read()
            if response is None:  # the call ended OK (a failed call raises from read())
                self._closed = True
                break
            kind = response.WhichOneof("event")
            if kind == "result":
                return core.result_from_proto(response.result)
            if kind == "turn":
                return core.turn_from_proto(response.turn)
            if kind == "rejected":
                raise core.rejection_error(response.rejected)
        raise StopAsyncIteration

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call.cancel()
        self._input_closed = True

    async def __aenter__(self) -> AsyncRolloutStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
