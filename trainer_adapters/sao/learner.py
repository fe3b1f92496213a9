"""`StreamingLearner`: SAO updates from rollouts as they arrive, with no group barrier.

It consumes `corral.sdk.RolloutResult`s one at a time (e.g. from `client.rollouts.stream(...)`),
forms an update batch as soon as it has the chosen number of rollouts or tokens, and steps the
optimiser with the SAO loss. Each generated token carries the weight version that produced it;
its staleness is the learner's policy version at training time minus that version. Tokens beyond
`max_staleness` are dropped (loss mask 0) or down-weighted (advantage scaled by
1 / (1 + versions beyond the limit)).

After every update the policy version goes up by one and `publish(version)` is awaited: that is
where a trainer saves the weights, pushes them to its inference servers and tells corral's daemon
the new version (`client.rollouts.set_policy_version`).

The optimiser step runs in a worker thread (`asyncio.to_thread`), so an event loop that also
serves rollouts (an in-process daemon, an inference server, the stream being read) keeps going
while the learner trains. Await one `update` at a time (`run` does): two at once would step
the same model from two threads.

Advantages without a critic: reward minus a per-task running baseline (starting at
`LearnerConfig.baseline_initial`), spread over the rollout's generated tokens. Filtered results
(infrastructure failures) are counted and never trained on.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

import torch

from corral.sdk.types import RolloutResult
from corral.trainer_adapters.sao.advantages import RunningBaseline
from corral.trainer_adapters.sao.loss import CODING, SAOConfig, sao_policy_loss

if TYPE_CHECKING:
    from corral.rollout.reference.tiny_model import TinyByteLM

# logprob_fn(model, prompt_ids, response_ids) -> logprobs of response_ids (1-D, with grad).
LogprobFn = Callable[[torch.nn.Module, Sequence[int], Sequence[int]], torch.Tensor]


@dataclass(frozen=True)
class LearnerConfig:
    # An update happens as soon as either count is reached (None: not used; at least one must be set).
    batch_rollouts: int | None = 8
    batch_tokens: int | None = None
    # Tokens more than this many versions behind the policy at training time are handled as
    # `stale_tokens` says. None: no limit.
    max_staleness: int | None = None
    stale_tokens: Literal["drop", "downweight"] = "drop"
    loss: SAOConfig = CODING
    baseline_momentum: float = 0.9
    # Every task's baseline before its first reward: e.g. the policy's measured success rate.
    baseline_initial: float = 0.0
    max_grad_norm: float | None = 1.0


@dataclass
class UpdateReport:
    version: int
    rollouts: int
    tokens: int
    loss: float
    mean_reward: float
    masked_fraction: float
    stale_dropped_fraction: float
    staleness_mean: float
    staleness_max: int


@dataclass
class LearnerStats:
    rollouts_seen: int = 0
    rollouts_filtered: int = 0
    rollouts_trained: int = 0
    tokens_trained: int = 0
    updates: list[UpdateReport] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def staleness_mean(self) -> float:
        return statistics.fmean(u.staleness_mean for u in self.updates) if self.updates else 0.0

    @property
    def staleness_max(self) -> int:
        return max((u.staleness_max for u in self.updates), default=0)

    @property
    def masked_fraction(self) -> float:
        return statistics.fmean(u.masked_fraction for u in self.updates) if self.updates else 0.0

    def throughput(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {
            "rollouts_per_s": self.rollouts_trained / elapsed,
            "tokens_per_s": self.tokens_trained / elapsed,
            "updates_per_s": len(self.updates) / elapsed,
        }


class StreamingLearner:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        logprob_fn: LogprobFn,
        *,
        config: LearnerConfig = LearnerConfig(),
        policy_version: int = 0,
        publish: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        if config.batch_rollouts is None and config.batch_tokens is None:
            raise ValueError("set batch_rollouts or batch_tokens")
        self.model = model
        self.optimizer = optimizer
        self.logprob_fn = logprob_fn
        self.config = config
        self.policy_version = policy_version
        self.publish = publish
        self.baseline = RunningBaseline(config.baseline_momentum, config.baseline_initial)
        self.stats = LearnerStats()
        self._pending: list[RolloutResult] = []

    async def run(self, results: AsyncIterable[RolloutResult], *, max_updates: int | None = None) -> LearnerStats:
        """Trains on results as they come until the stream ends (or `max_updates`); a partial
        batch left at the end is trained on too."""
        async for result in results:
            if self.add(result):
                await self.update()
                if max_updates is not None and len(self.stats.updates) >= max_updates:
                    return self.stats
        if self._pending:
            await self.update()
        return self.stats

    def add(self, result: RolloutResult) -> bool:
        """Takes one result; True when a batch is ready for `update`."""
        self.stats.rollouts_seen += 1
        if result.status != "completed" or not any(result.response_mask):
            self.stats.rollouts_filtered += int(result.status != "completed")
            return False
        self._pending.append(result)
        return self.batch_ready()

    def batch_ready(self) -> bool:
        config = self.config
        if config.batch_rollouts is not None and len(self._pending) >= config.batch_rollouts:
            return True
        tokens = sum(sum(r.response_mask) for r in self._pending)
        return config.batch_tokens is not None and tokens >= config.batch_tokens

    async def update(self) -> UpdateReport:
        """One optimiser step on the pending rollouts (in a worker thread), then the version bump
        and `publish`."""
        batch, self._pending = self._pending, []
        report = await asyncio.to_thread(self._step, batch)
        self.policy_version += 1
        report.version = self.policy_version
        self.stats.updates.append(report)
        self.stats.rollouts_trained += report.rollouts
        self.stats.tokens_trained += report.tokens
        if self.publish is not None:
            await self.publish(self.policy_version)
        return report

    def _step(self, batch: list[RolloutResult]) -> UpdateReport:
        width = max(len(r.response_ids) for r in batch)
        rollout = torch.zeros(len(batch), width)
        mask = torch.zeros(len(batch), width)
        advantages = torch.zeros(len(batch), width)
        staleness_values: list[int] = []
        stale_dropped = 0
        for row, result in enumerate(batch):
            n = len(result.response_ids)
            rollout[row, :n] = torch.tensor(result.response_logprobs)
            token_mask, weight = self._staleness_weights(result, staleness_values)
            stale_dropped += int((torch.tensor(result.response_mask[:n], dtype=torch.float32) - token_mask).sum())
            mask[row, :n] = token_mask
            advantages[row, :n] = self.baseline.advantage(result.task_id, result.reward) * weight * token_mask
        current = torch.nn.utils.rnn.pad_sequence(
            [self.logprob_fn(self.model, r.prompt_ids, r.response_ids) for r in batch], batch_first=True
        )
        loss, metrics = sao_policy_loss(current, rollout, advantages, mask, self.config.loss)
        self.optimizer.zero_grad()
        loss.backward()
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        generated = len(staleness_values)
        return UpdateReport(
            version=self.policy_version,
            rollouts=len(batch),
            tokens=int(mask.sum()),
            loss=float(loss.detach()),
            mean_reward=statistics.fmean(r.reward for r in batch),
            masked_fraction=metrics["masked_fraction"],
            stale_dropped_fraction=stale_dropped / generated if generated else 0.0,
            staleness_mean=statistics.fmean(staleness_values) if staleness_values else 0.0,
            staleness_max=max(staleness_values, default=0),
        )

    def _staleness_weights(
        self, result: RolloutResult, staleness_values: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss mask after dropping stale tokens, per-token advantage weight); records each
        generated token's staleness in `staleness_values`."""
        token_mask = torch.tensor(result.response_mask, dtype=torch.float32)
        weight = torch.ones(len(result.response_mask))
        limit = self.config.max_staleness
        for position, (generated, version) in enumerate(zip(result.response_mask, result.weight_versions)):
            if not generated:
                continue
            staleness = self.policy_version - version
            staleness_values.append(staleness)
            if limit is None or staleness <= limit:
                continue
            if self.config.stale_tokens == "drop":
                token_mask[position] = 0.0
            else:
                weight[position] = 1.0 / (1 + staleness - limit)
        return token_mask, weight


def tiny_byte_lm_logprobs(
    model: torch.nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float = 1.0
) -> torch.Tensor:
    """logprob_fn for `TinyByteLM` (the built-in tiny policy's network): the logprob of each
    response token given everything before it, as the tiny policy reports it when sampling at
    `temperature`."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    # A LogprobFn takes any Module; this one is for TinyByteLM only (its docstring).
    return cast("TinyByteLM", model).token_logprobs(ids, temperature)[0, len(prompt_ids) - 1 :]
