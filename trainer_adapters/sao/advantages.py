"""Advantages for learning from single rollouts, and group-normalised ones for comparison.

Token layout: (batch, tokens) tensors over a trajectory's response, with `loss_mask` 1 on
generated tokens and 0 on observation and template tokens (corral's response_mask) and on padding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over generated tokens only; returns (advantages, returns), zero off the mask.

    Observation tokens are skipped, not treated as steps: the value after the last generated token
    of a turn bootstraps from the next generated token (the first one after the observation), so
    the environment's reply is part of the transition, as in a multi-turn MDP whose actions are the
    model's tokens. After the last generated token the value is 0. `rewards` are per token
    (usually the outcome reward on the last generated token); rewards on masked-out tokens are
    ignored, so put them on generated tokens.
    """
    mask = loss_mask.bool()
    advantages = torch.zeros_like(values)
    batch = values.shape[0]
    for row in range(batch):
        positions = torch.nonzero(mask[row], as_tuple=False).flatten()
        if positions.numel() == 0:
            continue
        step_values = values[row, positions]
        step_rewards = rewards[row, positions]
        next_values = torch.cat([step_values[1:], step_values.new_zeros(1)])
        deltas = step_rewards + gamma * next_values - step_values
        running = step_values.new_zeros(())
        row_advantages = torch.empty_like(deltas)
        for step in range(deltas.numel() - 1, -1, -1):
            running = deltas[step] + gamma * lam * running
            row_advantages[step] = running
        advantages[row, positions] = row_advantages
    returns = (advantages + values) * mask.to(values.dtype)
    return advantages.detach(), returns.detach()


def sequence_advantages_to_tokens(advantages: Sequence[float] | torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence, given to every generated token of it (zero elsewhere)."""
    values = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1, 1)
    return values * loss_mask.to(torch.float32)


class RunningBaseline:
    """A per-task baseline for single rollouts without a critic: the advantage of a rollout is its
    reward minus the task's baseline, which starts at `initial` (a prior, e.g. the policy's
    measured success rate before training) and then moves towards each reward by
    (1 - `momentum`), the first one included. A task's first reward is thus weighed like every
    later one, so one lucky (or unlucky) first rollout does not become the whole baseline."""

    def __init__(self, momentum: float = 0.9, initial: float = 0.0) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError("momentum must be in [0, 1)")
        self.momentum = momentum
        self.initial = initial
        self._means: dict[Hashable, float] = {}

    def baseline(self, task_id: Hashable) -> float:
        return self._means.get(task_id, self.initial)

    def advantage(self, task_id: Hashable, reward: float) -> float:
        """reward - baseline(task), then the baseline moves towards reward."""
        mean = self.baseline(task_id)
        self._means[task_id] = self.momentum * mean + (1.0 - self.momentum) * reward
        return reward - mean


def group_normalized_advantages(
    rewards: Sequence[float], group_ids: Sequence[Hashable], *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO/DAPO: each reward minus its group's mean, divided by the group's standard deviation
    (population std; `scale=False` leaves it unscaled, as Dr. GRPO does). A group of one, or one
    whose rewards are all equal, gets advantage 0: it carries no signal."""
    rewards_t = torch.as_tensor(rewards, dtype=torch.float32)
    advantages = torch.zeros_like(rewards_t)
    groups: dict[Hashable, list[int]] = {}
    for index, group in enumerate(group_ids):
        groups.setdefault(group, []).append(index)
    for members in groups.values():
        member_rewards = rewards_t[members]
        centred = member_rewards - member_rewards.mean()
        if scale:
            centred = centred / (member_rewards.std(unbiased=False) + eps)
        advantages[members] = centred
    return advantages
