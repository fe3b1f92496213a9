"""RolloutService messages without I/O: building its requests (options, submissions, cancels) and
decoding its replies into `corral.sdk.types` values. The clients make the calls; trainer adapters
that drive a `corral.rollout` pipeline in their own process use the same conversions."""

from __future__ import annotations

from typing import Any, Literal, cast

import grpc

from corral.sdk.enums import enum_name
from corral.sdk.errors import CorralError, InvalidArgument, error_class_for
from corral.sdk.tasks import TaskLike, task_from
from corral.sdk.types import (
    EvalSandbox,
    FilterReason,
    FinishReason,
    GatewayCounters,
    LLMProtocolName,
    LLMServerInfo,
    RolloutResult,
    RolloutSample,
    RolloutStats,
    RolloutStatus,
    RolloutTurn,
    StageStats,
    ToolCallRecord,
)
from corral.v1 import rollout_pb2 as pb

_PROTOCOLS = {"sglang": pb.LLM_PROTOCOL_SGLANG, "vllm": pb.LLM_PROTOCOL_VLLM}


def build_register_llm_request(address: str, protocol: str, weight: int, model: str) -> pb.RegisterLLMRequest:
    if protocol not in _PROTOCOLS:
        raise InvalidArgument(f"unknown LLM protocol {protocol!r}; choose one of {sorted(_PROTOCOLS)}")
    return pb.RegisterLLMRequest(address=address, protocol=_PROTOCOLS[protocol], weight=weight, model=model)


def build_options(
    *, n: int = 1, max_staleness: int | None = None, stream_turns: bool = False, group_id: str | None = None
) -> pb.RolloutOptions:
    if n < 1:
        raise InvalidArgument(f"n must be at least 1, got {n}")
    options = pb.RolloutOptions(n=n, stream_turns=stream_turns, group_id=group_id or "")
    if max_staleness is not None:
        options.max_staleness = max_staleness
    return options


def build_run_request(task: TaskLike, max_staleness: int | None) -> pb.RunRequest:
    return pb.RunRequest(task=task_from(task), options=build_options(max_staleness=max_staleness))


def build_submit(task: TaskLike, options: pb.RolloutOptions, client_ref: str = "") -> pb.StreamRequest:
    return pb.StreamRequest(submit=pb.SubmitRollout(task=task_from(task), options=options, client_ref=client_ref))


def build_cancel(*, task_id: str | None = None, rollout_id: str | None = None) -> pb.StreamRequest:
    if not (task_id or rollout_id):
        raise InvalidArgument("name a task_id or a rollout_id to cancel")
    return pb.StreamRequest(cancel=pb.CancelRollout(task_id=task_id or "", rollout_id=rollout_id or ""))


def rejection_error(rejected: pb.RolloutRejected) -> CorralError:
    """The error a rejected submission raises, as if the daemon had returned its status."""
    code = getattr(grpc.StatusCode, rejected.code, None)
    error_class = error_class_for(code)
    return error_class(f"task {rejected.task_id!r} was rejected: {rejected.message}", code=code)


def turn_from_proto(turn: pb.Turn) -> RolloutTurn:
    return RolloutTurn(
        rollout_id=turn.rollout_id,
        index=turn.index,
        generated_ids=list(turn.generated_ids),
        generated_logprobs=list(turn.generated_logprobs),
        weight_version=turn.weight_version,
        tool_calls=[ToolCallRecord(call.name, call.arguments_json) for call in turn.tool_calls],
        observation_ids=list(turn.observation_ids),
        format_error=turn.format_error,
        llm_finish_reason=turn.llm_finish_reason,
        llm_address=turn.llm_address,
        llm_time_ms=turn.llm_time_ms,
        tool_time_ms=turn.tool_time_ms,
    )


def result_from_proto(result: pb.RolloutResult) -> RolloutResult:
    timings = result.timings
    return RolloutResult(
        rollout_id=result.rollout_id,
        task_id=result.task_id,
        group_id=result.group_id,
        sample_index=result.sample_index,
        # enum_name gives one of the contract's value names or "unknown"; the Literal types list
        # exactly those (test_sdk_core checks it).
        status=cast(RolloutStatus, enum_name(pb.RolloutStatus, "ROLLOUT_STATUS_", result.status)),
        filter_reason=(
            cast(FilterReason, enum_name(pb.FilterReason, "FILTER_REASON_", result.filter_reason))
            if result.filter_reason
            else None
        ),
        error=result.error,
        reward=result.reward,
        finish_reason=(
            cast(FinishReason, enum_name(pb.FinishReason, "FINISH_REASON_", result.finish_reason))
            if result.finish_reason
            else None
        ),
        **_sequence(result),
        messages=[{"role": m.role, "content": m.content} for m in result.messages],
        timings={
            name: getattr(timings, f"{name}_ms") / 1000
            for name in (
                "init_queue",
                "init",
                "fork",
                "run_queue",
                "run",
                "eval_queue",
                "eval",
                "eval_change",
                "eval_sandbox",
                "total",
            )
        },
        format_errors=result.format_errors,
        eval_output=result.eval_output,
        metadata=dict(result.metadata),
        extra_samples=[sample_from_proto(sample) for sample in result.extra_samples],
        gateway=gateway_counters_from_proto(result.gateway) if result.HasField("gateway") else None,
        init_shared_by=timings.init_shared_by,
        init_fell_back=timings.init_fell_back,
        eval_sandbox=cast(EvalSandbox, enum_name(pb.EvalSandbox, "EVAL_SANDBOX_", timings.eval_sandbox)),
    )


def sample_from_proto(sample: pb.Sample) -> RolloutSample:
    return RolloutSample(**_sequence(sample))


def _sequence(message: pb.RolloutResult | pb.Sample) -> dict[str, Any]:
    """The token sequence's fields, which a result and a Sample name alike."""
    return {
        "prompt_ids": list(message.prompt_ids),
        "response_ids": list(message.response_ids),
        "response_mask": list(message.response_mask),
        "response_logprobs": list(message.response_logprobs),
        "weight_versions": list(message.weight_versions),
        "turns": [turn_from_proto(turn) for turn in message.turns],
    }


def gateway_counters_from_proto(counters: pb.GatewayCounters) -> GatewayCounters:
    return GatewayCounters(**{field.name: getattr(counters, field.name) for field in counters.DESCRIPTOR.fields})


def llm_server_from_proto(server: pb.LLMServer) -> LLMServerInfo:
    return LLMServerInfo(
        address=server.address,
        protocol=llm_protocol_name(server.protocol),
        weight=server.weight,
        model=server.model,
        in_flight=server.in_flight,
        healthy=server.healthy,
        requests=server.requests,
        failures=server.failures,
    )


def llm_protocol_name(number: int) -> LLMProtocolName | Literal["unknown"]:
    """The contract's LLMProtocol number as a name: UNSPECIFIED means SGLang (rollout.proto)."""
    if number in (pb.LLM_PROTOCOL_UNSPECIFIED, pb.LLM_PROTOCOL_SGLANG):
        return "sglang"
    if number == pb.LLM_PROTOCOL_VLLM:
        return "vllm"
    return "unknown"


def stats_from_proto(response: pb.GetRolloutStatsResponse) -> RolloutStats:
    def stage(stats: pb.StageStats) -> StageStats:
        return StageStats(
            queued=stats.queued,
            in_flight=stats.in_flight,
            workers=stats.workers,
            completed=stats.completed,
            throughput_per_s=stats.throughput_per_s,
        )

    return RolloutStats(
        init=stage(response.init),
        run=stage(response.run),
        eval=stage(response.eval),
        llm_servers=[llm_server_from_proto(s) for s in response.llm_servers],
        policy_version=response.policy_version,
        results_completed=response.results_completed,
        results_filtered=response.results_filtered,
        results_cancelled=response.results_cancelled,
    )
