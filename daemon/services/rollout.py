"""RolloutService: translates corral.v1 rollout messages to calls on the daemon's rollout runtime
(RolloutRuntime: its pipeline and LLM pool) and back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from corral.rollout.pipeline import Stage
from corral.sdk.errors import CorralError, InvalidArgument
from corral.v1 import rollout_pb2 as pb
from corral.v1 import rollout_pb2_grpc

from ..llm_pool import ServerStats
from ..rollout_runtime import RolloutRuntime

_PROTOCOL_NAMES = {
    pb.LLM_PROTOCOL_UNSPECIFIED: "sglang",
    pb.LLM_PROTOCOL_SGLANG: "sglang",
    pb.LLM_PROTOCOL_VLLM: "vllm",
}
_PROTOCOL_NUMBERS = {"sglang": pb.LLM_PROTOCOL_SGLANG, "vllm": pb.LLM_PROTOCOL_VLLM}


def server_to_proto(server: ServerStats) -> pb.LLMServer:
    return pb.LLMServer(
        address=server.address,
        protocol=_PROTOCOL_NUMBERS[server.protocol],
        weight=server.weight,
        in_flight=server.in_flight,
        healthy=server.healthy,
        requests=server.requests,
        failures=server.failures,
        model=server.model,
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, rollouts: RolloutRuntime) -> None:
        self.rollouts = rollouts
        self.pipeline = rollouts.pipeline
        self.llms = rollouts.llms

    async def RegisterLLM(self, request: pb.RegisterLLMRequest, context) -> pb.RegisterLLMResponse:
        protocol = _PROTOCOL_NAMES.get(request.protocol)
        if protocol is None:
            raise InvalidArgument(f"unknown LLM protocol {request.protocol}")
        server = self.llms.register(request.address, protocol=protocol, weight=request.weight or 1, model=request.model)
        return pb.RegisterLLMResponse(server=server_to_proto(server))

    async def RemoveLLM(self, request: pb.RemoveLLMRequest, context) -> pb.RemoveLLMResponse:
        self.llms.remove(request.address)
        return pb.RemoveLLMResponse()

    async def ListLLMs(self, request: pb.ListLLMsRequest, context) -> pb.ListLLMsResponse:
        return pb.ListLLMsResponse(servers=[server_to_proto(s) for s in self.llms.snapshot()])

    async def SetPolicyVersion(self, request: pb.SetPolicyVersionRequest, context) -> pb.SetPolicyVersionResponse:
        self.pipeline.set_policy_version(request.version)
        return pb.SetPolicyVersionResponse(version=self.pipeline.policy_version)

    async def Run(self, request: pb.RunRequest, context) -> pb.RunResponse:
        options = pb.RolloutOptions()
        options.CopyFrom(request.options)
        if options.n > 1:
            raise InvalidArgument("Run takes one rollout (n <= 1); use Stream for several samples")
        options.stream_turns = False
        done: asyncio.Future[pb.RolloutResult] = asyncio.get_running_loop().create_future()

        def deliver(result: pb.RolloutResult) -> None:
            if not done.done():
                done.set_result(result)

        rollouts = await self.rollouts.submit(request.task, options, deliver)
        try:
            return pb.RunResponse(result=await done)
        finally:
            if not done.done():  # the caller went away: free the sandbox now
                for rollout in rollouts:
                    self.pipeline.cancel(rollout.rollout_id)

    async def Stream(
        self, request_iterator: AsyncIterator[pb.StreamRequest], context
    ) -> AsyncIterator[pb.StreamResponse]:
        session = _StreamSession(self)
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while True:
                event = await session.events.get()
                if event is None:  # input finished and every accepted rollout delivered
                    break
                yield event
            await reader  # re-raises a broken request stream
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            session.cancel_unfinished()

    async def GetRolloutStats(self, request: pb.GetRolloutStatsRequest, context) -> pb.GetRolloutStatsResponse:
        totals = self.pipeline.totals
        return pb.GetRolloutStatsResponse(
            init=self.pipeline.stage_stats(Stage.INIT),
            run=self.pipeline.stage_stats(Stage.RUN),
            eval=self.pipeline.stage_stats(Stage.EVAL),
            llm_servers=[server_to_proto(s) for s in self.llms.snapshot()],
            policy_version=self.pipeline.policy_version,
            results_completed=totals[pb.ROLLOUT_STATUS_COMPLETED],
            results_filtered=totals[pb.ROLLOUT_STATUS_FILTERED],
            results_cancelled=totals[pb.ROLLOUT_STATUS_CANCELLED],
        )


class _StreamSession:
    """The rollouts of one Stream call: what was accepted, what is still running, and the events
    waiting to be sent (None marks the end)."""

    def __init__(self, servicer: RolloutServicer) -> None:
        self.servicer = servicer
        self.events: asyncio.Queue[pb.StreamResponse | None] = asyncio.Queue()
        self.unfinished: dict[str, str] = {}  # rollout id -> task id
        self.finished: set[str] = set()
        self.input_done = False

    async def read(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                if kind == "submit":
                    await self.submit(request.submit)
                elif kind == "cancel":
                    self.cancel(request.cancel)
        finally:
            self.input_done = True
            self._maybe_end()

    async def submit(self, submit: pb.SubmitRollout) -> None:
        try:
            rollouts = await self.servicer.rollouts.submit(submit.task, submit.options, self.deliver, self.send_turn)
        except CorralError as error:
            # One bad submission must not end the stream: it is answered in-band, with the status
            # code the call would have had on its own.
            code = error.code or grpc.StatusCode.INTERNAL
            self.events.put_nowait(
                pb.StreamResponse(
                    rejected=pb.RolloutRejected(
                        client_ref=submit.client_ref, task_id=submit.task.task_id, code=code.name, message=str(error)
                    )
                )
            )
            return
        for rollout in rollouts:
            if rollout.rollout_id not in self.finished:
                self.unfinished[rollout.rollout_id] = rollout.task.task_id
        self.events.put_nowait(
            pb.StreamResponse(
                accepted=pb.RolloutAccepted(
                    client_ref=submit.client_ref,
                    task_id=submit.task.task_id,
                    group_id=rollouts[0].group_id,
                    rollout_ids=[r.rollout_id for r in rollouts],
                )
            )
        )

    def deliver(self, result: pb.RolloutResult) -> None:
        self.unfinished.pop(result.rollout_id, None)
        self.finished.add(result.rollout_id)
        self.events.put_nowait(pb.StreamResponse(result=result))
        self._maybe_end()

    def send_turn(self, turn: pb.Turn) -> None:
        self.events.put_nowait(pb.StreamResponse(turn=turn))

    def cancel(self, cancel: pb.CancelRollout) -> None:
        for rollout_id, task_id in list(self.unfinished.items()):
            if rollout_id == cancel.rollout_id or (cancel.task_id and task_id == cancel.task_id):
                self.servicer.pipeline.cancel(rollout_id)

    def cancel_unfinished(self) -> None:
        for rollout_id in list(self.unfinished):
            self.servicer.pipeline.cancel(rollout_id)

    def _maybe_end(self) -> None:
        if self.input_done and not self.unfinished:
            self.events.put_nowait(None)
