"""Turning a rollout's trajectory, evaluation and timings into a `corral.v1.RolloutResult`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from corral.rollout.gateway import GatewayCounters
from corral.rollout.types import FinishReason, Trajectory, TurnRecord
from corral.v1 import rollout_pb2 as pb


def turn_to_proto(turn: TurnRecord, rollout_id: str = "") -> pb.Turn:
    return pb.Turn(
        index=turn.index,
        generated_ids=turn.generated_ids,
        generated_logprobs=turn.generated_logprobs,
        weight_version=turn.weight_version,
        tool_calls=[pb.ToolCall(name=call.name, arguments_json=call.arguments_json()) for call in turn.tool_calls],
        observation_ids=turn.observation_ids,
        format_error=turn.format_error,
        llm_finish_reason=turn.llm_finish_reason,
        llm_time_ms=round(turn.llm_time_s * 1000),
        tool_time_ms=round(turn.tool_time_s * 1000),
        rollout_id=rollout_id,
        llm_address=turn.llm_server,
    )


def finish_reason_to_proto(reason: FinishReason | None) -> pb.FinishReason:
    if reason is None:
        return pb.FINISH_REASON_UNSPECIFIED
    return pb.FinishReason.Value(f"FINISH_REASON_{reason.value}")


def fill_trajectory(result: pb.RolloutResult, trajectory: Trajectory) -> None:
    """Copies the token-exact trajectory into a result."""
    result.finish_reason = finish_reason_to_proto(trajectory.finish_reason)
    _copy_sequence(result, trajectory, result.rollout_id)
    result.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in trajectory.messages)
    result.format_errors = trajectory.format_errors


def _copy_sequence(target: pb.RolloutResult | pb.Sample, trajectory: Trajectory, rollout_id: str) -> None:
    """The token sequence's fields, which a result and a Sample name alike."""
    target.prompt_ids.extend(trajectory.prompt_ids)
    target.response_ids.extend(trajectory.response_ids)
    target.response_mask.extend(trajectory.response_mask)
    target.response_logprobs.extend(trajectory.response_logprobs)
    target.weight_versions.extend(trajectory.weight_versions)
    target.turns.extend(turn_to_proto(turn, rollout_id) for turn in trajectory.turns)


def sample_to_proto(trajectory: Trajectory, rollout_id: str = "") -> pb.Sample:
    sample = pb.Sample()
    _copy_sequence(sample, trajectory, rollout_id)
    return sample


def fill_gateway(
    result: pb.RolloutResult, extra_samples: Sequence[Trajectory], counters: GatewayCounters | None
) -> None:
    """A harness rollout's samples after the first, and what its gateway session counted."""
    result.extra_samples.extend(sample_to_proto(sample, result.rollout_id) for sample in extra_samples)
    if counters is not None:
        # The proto's counters are the gateway's, by name.
        result.gateway.CopyFrom(
            pb.GatewayCounters(**{f.name: getattr(counters, f.name) for f in pb.GatewayCounters.DESCRIPTOR.fields})
        )


def stage_timings(
    seconds: Mapping[str, float],
    *,
    init_shared_by: int = 0,
    init_fell_back: bool = False,
    eval_sandbox: pb.EvalSandbox = pb.EVAL_SANDBOX_UNSPECIFIED,
) -> pb.StageTimings:
    """StageTimings from {"init_queue": s, "init": s, "fork": s, ..., "total": s} (missing stages
    stay 0), how the INIT went (INIT once) and where the evaluation ran."""
    timings = pb.StageTimings(init_shared_by=init_shared_by, init_fell_back=init_fell_back, eval_sandbox=eval_sandbox)
    for name, value in seconds.items():
        setattr(timings, f"{name}_ms", round(value * 1000))
    return timings
