"""StreamingLearner: batches form as results arrive, staleness is tracked and enforced, filtered
results are never trained on, and updates really move the policy (the tiny byte-level GRU)."""

from __future__ import annotations

import pytest

from tests.torch_needed import TORCH_MISSING

pytest.importorskip("torch", reason=TORCH_MISSING)

import asyncio
import threading

import torch

from corral.rollout.reference.tiny_model import TinyByteLM
from corral.sdk.rollout_messages import result_from_proto
from corral.trainer_adapters.sao import LearnerConfig, StreamingLearner, tiny_byte_lm_logprobs
from corral.v1 import rollout_pb2 as pb

PROMPT = list(b"<task>")
GENERATED = list(b"ls")
OBSERVATION = list(b"file.txt")


def make_model() -> TinyByteLM:
    torch.manual_seed(0)
    return TinyByteLM(embed_dim=16, hidden_dim=32, num_layers=1)


def result(
    model: TinyByteLM,
    *,
    task_id: str = "t",
    reward: float = 1.0,
    version: int = 0,
    status: pb.RolloutStatus = pb.ROLLOUT_STATUS_COMPLETED,
):
    """A one-turn rollout (generated ids, then an observation) whose logprobs are the model's own,
    as if the model had sampled it at `version`."""
    response = GENERATED + OBSERVATION
    with torch.no_grad():
        logprobs = tiny_byte_lm_logprobs(model, PROMPT, response).tolist()
    mask = [1] * len(GENERATED) + [0] * len(OBSERVATION)
    return result_from_proto(
        pb.RolloutResult(
            task_id=task_id,
            status=status,
            reward=reward,
            prompt_ids=PROMPT,
            response_ids=response,
            response_mask=mask,
            response_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, mask)],
            weight_versions=[version if m else -1 for m in mask],
        )
    )


def learner(model: TinyByteLM, **config) -> tuple[StreamingLearner, list[int]]:
    published: list[int] = []

    async def publish(version: int) -> None:
        published.append(version)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return StreamingLearner(
        model, optimizer, tiny_byte_lm_logprobs, config=LearnerConfig(**config), publish=publish
    ), published


def generated_logprob(model: TinyByteLM) -> float:
    with torch.no_grad():
        return float(tiny_byte_lm_logprobs(model, PROMPT, GENERATED + OBSERVATION)[: len(GENERATED)].sum())


async def test_batches_form_by_rollout_count_without_waiting_for_a_group() -> None:
    model = make_model()
    sao, published = learner(model, batch_rollouts=2)
    assert not sao.add(result(model, task_id="a"))
    assert sao.add(result(model, task_id="b"))
    report = await sao.update()
    assert (report.version, report.rollouts, report.tokens) == (1, 2, 2 * len(GENERATED))
    assert published == [1] and sao.policy_version == 1


async def test_batches_form_by_token_count() -> None:
    model = make_model()
    sao, _ = learner(model, batch_rollouts=None, batch_tokens=3)
    assert not sao.add(result(model))  # 2 generated tokens
    assert sao.add(result(model))  # 4 >= 3


async def test_a_positive_advantage_raises_the_generated_tokens_probability() -> None:
    model = make_model()
    before = generated_logprob(model)
    sao, _ = learner(model, batch_rollouts=1)
    sao.add(result(model, reward=1.0))  # first rollout of the task: advantage 1 - 0
    await sao.update()
    assert generated_logprob(model) > before
    assert sao.stats.updates[0].masked_fraction == 0.0  # ratio 1: nothing outside the band


async def test_stale_tokens_are_dropped_or_down_weighted() -> None:
    model = make_model()
    sao, _ = learner(model, batch_rollouts=1, max_staleness=2)
    sao.policy_version = 5
    sao.add(result(model, version=1))  # 4 versions behind: beyond the limit
    report = await sao.update()
    assert (report.staleness_mean, report.staleness_max, report.stale_dropped_fraction) == (4, 4, 1.0)
    assert report.tokens == 0 and report.loss == 0.0

    losses = {}
    for mode in ("downweight", None):
        model = make_model()
        sao, _ = learner(model, batch_rollouts=1, max_staleness=2 if mode else None, stale_tokens=mode or "drop")
        sao.policy_version = 5
        sao.add(result(model, version=1))
        losses[mode] = (await sao.update()).loss
    # Advantage 1 with ratio 1: loss -1 per token; 2 versions beyond the limit weigh 1/3.
    assert losses[None] == pytest.approx(-1.0)
    assert losses["downweight"] == pytest.approx(-1.0 / 3)


async def test_filtered_results_are_counted_and_never_trained_on() -> None:
    model = make_model()
    sao, published = learner(model, batch_rollouts=1)
    assert not sao.add(result(model, status=pb.ROLLOUT_STATUS_FILTERED))
    assert sao.stats.rollouts_filtered == 1 and published == []


async def test_run_consumes_a_stream_and_trains_the_last_partial_batch() -> None:
    model = make_model()
    sao, published = learner(model, batch_rollouts=2)

    async def stream():
        for index in range(5):
            yield result(model, task_id=f"t{index % 2}", reward=float(index % 2))

    stats = await sao.run(stream())
    assert published == [1, 2, 3] and stats.rollouts_trained == 5
    assert stats.throughput()["rollouts_per_s"] > 0
    assert stats.staleness_max >= 1  # rollouts made at version 0 trained at versions 1 and 2


async def test_max_updates_stops_early() -> None:
    model = make_model()
    sao, published = learner(model, batch_rollouts=1)

    async def stream():
        while True:
            yield result(model)

    await sao.run(stream(), max_updates=3)
    assert published == [1, 2, 3]


def test_a_learner_needs_a_batch_size() -> None:
    model = make_model()
    with pytest.raises(ValueError):
        StreamingLearner(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            tiny_byte_lm_logprobs,
            config=LearnerConfig(batch_rollouts=None, batch_tokens=None),
        )


async def test_the_event_loop_keeps_running_while_the_learner_trains() -> None:
    """The optimiser step runs off the loop: a coroutine beside `update` (standing in for an
    in-process daemon or inference server) keeps being scheduled while a slow step runs."""
    model = make_model()
    step_started, step_may_finish = threading.Event(), threading.Event()

    def slow_logprobs(m, prompt, response):
        step_started.set()
        assert step_may_finish.wait(5), "the loop never got to run while the step was under way"
        return tiny_byte_lm_logprobs(m, prompt, response)

    sao = StreamingLearner(
        model, torch.optim.SGD(model.parameters(), lr=0.1), slow_logprobs, config=LearnerConfig(batch_rollouts=1)
    )
    sao.add(result(model))
    update = asyncio.create_task(sao.update())
    while not step_started.is_set():
        await asyncio.sleep(0.005)
    step_may_finish.set()  # only reachable because the loop is free during the step
    report = await update
    assert report.version == 1


async def test_baselines_start_from_the_configured_prior() -> None:
    model = make_model()
    sao, _ = learner(model, batch_rollouts=1, baseline_initial=0.25, baseline_momentum=0.5)
    assert sao.baseline.baseline("t") == 0.25
    sao.add(result(model, reward=1.0))
    await sao.update()
    assert sao.baseline.baseline("t") == pytest.approx(0.625)
