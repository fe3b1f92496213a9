"""The SAO loss and the advantages, against values worked out by hand on small tensors."""

from __future__ import annotations

import pytest

from tests.torch_needed import TORCH_MISSING

pytest.importorskip("torch", reason=TORCH_MISSING)

import math

import torch

from corral.trainer_adapters.sao import (
    CODING,
    MATHS,
    RunningBaseline,
    SAOConfig,
    clipped_policy_loss,
    gae_advantages,
    group_normalized_advantages,
    sao_policy_loss,
    sequence_advantages_to_tokens,
)


def logs(*ratios: float) -> torch.Tensor:
    """Current logprobs whose ratio against rollout logprobs of 0 are `ratios`."""
    return torch.log(torch.tensor([ratios], dtype=torch.float64))


def test_presets_are_the_papers() -> None:
    assert (CODING.eps_low, CODING.eps_high) == (0.8, 3.0)
    assert (MATHS.eps_low, MATHS.eps_high) == (0.3, 5.0)


def test_tokens_outside_the_band_contribute_nothing_on_either_side() -> None:
    # Band (0.2, 4.0). Ratios 0.1 and 5.0 are out, whatever the advantage's sign; 0.5 and 2 are in.
    config = SAOConfig(eps_low=0.8, eps_high=3.0)
    current = logs(0.1, 0.5, 2.0, 5.0).requires_grad_()
    old = torch.zeros_like(current)
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(current)
    loss, metrics = sao_policy_loss(current, old, advantages, mask, config)
    # Kept: -0.5*(-1) + -2*(1) = 0.5 - 2 = -1.5, over 4 loss tokens.
    assert loss.item() == pytest.approx(-1.5 / 4)
    loss.backward()
    assert current.grad is not None
    # d(-r*A)/dlogp = -r*A on kept tokens, divided by 4; zero on masked ones.
    assert current.grad[0].tolist() == pytest.approx([0.0, 0.5 / 4, -2.0 / 4, 0.0])
    assert metrics["masked_fraction"] == 0.5
    assert metrics["masked_below_fraction"] == 0.25 and metrics["masked_above_fraction"] == 0.25


def test_the_band_is_strict_at_its_edges() -> None:
    config = SAOConfig(eps_low=0.5, eps_high=1.0)  # band (0.5, 2.0)
    current = logs(0.5, 2.0, 1.0)
    loss, metrics = sao_policy_loss(
        current, torch.zeros_like(current), torch.ones_like(current), torch.ones_like(current), config
    )
    assert metrics["masked_fraction"] == pytest.approx(2 / 3)
    assert loss.item() == pytest.approx(-1.0 / 3)


def test_unlike_ppo_the_sao_mask_drops_tokens_on_both_sides() -> None:
    # Ratio 5 with a negative advantage: PPO keeps the unclipped term (-r*A = 5, the larger),
    # so the token still pushes; SAO drops it.
    current = logs(5.0)
    zero, mask, negative = torch.zeros_like(current), torch.ones_like(current), -torch.ones_like(current)
    ppo, _ = clipped_policy_loss(current, zero, negative, mask, eps_low=0.2, eps_high=0.2)
    sao, _ = sao_policy_loss(current, zero, negative, mask, CODING)
    assert ppo.item() == pytest.approx(5.0)
    assert sao.item() == 0.0


def test_zero_advantage_tokens_give_zero_loss_and_gradient() -> None:
    current = logs(1.2, 0.9).requires_grad_()
    loss, _ = sao_policy_loss(current, torch.zeros_like(current), torch.zeros_like(current), torch.ones_like(current))
    loss.backward()
    assert current.grad is not None
    assert loss.item() == 0.0 and current.grad.abs().sum().item() == 0.0


def test_a_fully_masked_batch_is_zero_with_a_graph() -> None:
    current = logs(1.0, 1.0).requires_grad_()
    loss, metrics = sao_policy_loss(
        current, torch.zeros_like(current), torch.ones_like(current), torch.zeros_like(current)
    )
    loss.backward()  # no error: a step with nothing to learn from is harmless
    assert loss.item() == 0.0 and metrics["masked_fraction"] == 0.0


def test_observation_tokens_are_excluded_by_the_trajectory_loss_mask() -> None:
    # A trajectory: generated, generated, observation, observation, generated (response_mask).
    response_mask = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.float64)
    current = logs(1.5, 1.0, 9.0, 0.01, 0.5)  # observation "ratios" are meaningless and must not count
    advantages = torch.full_like(current, 2.0)
    loss, metrics = sao_policy_loss(current, torch.zeros_like(current), advantages, response_mask, CODING)
    assert loss.item() == pytest.approx(-(1.5 + 1.0 + 0.5) * 2.0 / 3)
    assert metrics["masked_fraction"] == 0.0


def test_denominators() -> None:
    current = logs(1.0, 10.0, 1.0, 1.0)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.float64)
    adv = torch.ones_like(current)
    zero = torch.zeros_like(current)
    token, _ = sao_policy_loss(current, zero, adv, mask, SAOConfig(denominator="token"))
    kept, _ = sao_policy_loss(current, zero, adv, mask, SAOConfig(denominator="kept"))
    assert token.item() == pytest.approx(-2 / 3) and kept.item() == pytest.approx(-1.0)
    batch = torch.cat([logs(1.0, 1.0), logs(2.0, 1.0)])
    seq_mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.float64)
    sequence, _ = sao_policy_loss(
        batch, torch.zeros_like(batch), torch.ones_like(batch), seq_mask, SAOConfig(denominator="sequence")
    )
    assert sequence.item() == pytest.approx((-1.0 + -2.0) / 2)  # each sequence's mean, then the mean


def test_stopping_the_ratio_gradient_keeps_the_gradient() -> None:
    grads = []
    for mode in ("through", "stop"):
        current = logs(1.5, 0.7).requires_grad_()
        loss, _ = sao_policy_loss(
            current,
            torch.zeros_like(current),
            torch.tensor([[1.0, -2.0]], dtype=torch.float64),
            torch.ones_like(current),
            SAOConfig(ratio_grad=mode),
        )
        loss.backward()
        assert current.grad is not None
        grads.append(current.grad[0].tolist())
    assert grads[0] == pytest.approx(grads[1])


def test_gae_skips_observation_tokens() -> None:
    # Generated at 0, 1, 4 (2 and 3 are an observation); reward 1 on the last generated token.
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    values = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.8]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # Steps over generated tokens only: V = 0.5, 0.6, 0.8, then 0.
    d2 = 1.0 + 0.9 * 0.0 - 0.8  # 0.2
    d1 = 0.0 + 0.9 * 0.8 - 0.6  # 0.12: bootstraps from the token after the observation
    d0 = 0.0 + 0.9 * 0.6 - 0.5  # 0.04
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    assert advantages.tolist()[0] == pytest.approx([a0, a1, 0.0, 0.0, a2])
    assert returns.tolist()[0] == pytest.approx([a0 + 0.5, a1 + 0.6, 0.0, 0.0, a2 + 0.8])


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value() -> None:
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0]])
    values = torch.tensor([[0.2, 5.0, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    advantages, _ = gae_advantages(rewards, values, mask)
    assert advantages[0].tolist() == pytest.approx([0.8, 0.0, 0.7, 0.6])
    assert advantages[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_running_baseline_per_task() -> None:
    baseline = RunningBaseline(momentum=0.5)
    assert baseline.advantage("a", 1.0) == 1.0  # first: against initial 0; mean becomes 0.5
    assert baseline.advantage("a", 0.0) == -0.5  # against 0.5; mean becomes 0.25
    assert baseline.advantage("a", 1.0) == 0.75  # against 0.25; mean becomes 0.625
    assert baseline.advantage("b", 0.0) == 0.0  # tasks are separate
    assert baseline.baseline("a") == pytest.approx(0.625)
    assert baseline.baseline("never seen") == 0.0
    with pytest.raises(ValueError):
        RunningBaseline(momentum=1.0)


def test_running_baseline_starts_from_its_prior() -> None:
    """The first reward moves the baseline from `initial` like any other: it does not replace it."""
    baseline = RunningBaseline(momentum=0.9, initial=0.2)
    assert baseline.advantage("a", 1.0) == pytest.approx(0.8)
    assert baseline.baseline("a") == pytest.approx(0.28)
    assert baseline.advantage("a", 0.0) == pytest.approx(-0.28)
    assert baseline.baseline("b") == pytest.approx(0.2)


def test_group_normalised_advantages() -> None:
    advantages = group_normalized_advantages([1.0, 0.0, 1.0, 1.0, 0.5], ["g", "g", "h", "h", "i"])
    assert advantages[:2].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert advantages[2:].tolist() == [0.0, 0.0, 0.0]  # equal rewards and a group of one: no signal
    unscaled = group_normalized_advantages([1.0, 0.0], ["g", "g"], scale=False)
    assert unscaled.tolist() == [0.5, -0.5]


def test_sequence_advantages_reach_generated_tokens_only() -> None:
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    assert sequence_advantages_to_tokens([2.0, -1.0], mask).tolist() == [[2.0, 0.0, 2.0], [0.0, -1.0, -1.0]]


def test_dapo_decoupled_clip() -> None:
    current = logs(1.5, 0.5)
    zero, mask = torch.zeros_like(current), torch.ones_like(current)
    positive = torch.ones_like(current)
    loss, metrics = clipped_policy_loss(current, zero, positive, mask, eps_low=0.2, eps_high=0.28)
    # Positive advantage: min(r, clip(r)) -> 1.28 for r=1.5, 0.5 for r=0.5 (clip only bounds above).
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2)
    assert metrics["clip_fraction"] == 0.5
    assert math.isfinite(metrics["ratio_mean"])
