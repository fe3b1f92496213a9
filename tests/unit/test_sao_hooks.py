"""The SAO loss in the trainers' own loss slots: veRL's policy-loss registry (the real package) and
Miles' custom loss function (Miles cannot be installed here: its two helpers are stand-ins, see
`miles_stand_in`)."""

from __future__ import annotations

import pytest

from tests.torch_needed import TORCH_MISSING

pytest.importorskip("torch", reason=TORCH_MISSING)

import argparse
import sys
import types

import torch

from corral.trainer_adapters.sao import CODING, sao_policy_loss
from corral.trainer_adapters.sao.hooks import miles_sao_loss
from tests.conftest import require_trainer


def test_verl_registry_gets_sao_and_it_matches_the_reference_loss() -> None:
    require_trainer("verl", "verl", "verl")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from corral.trainer_adapters.sao.hooks import register_verl_policy_loss

    register_verl_policy_loss()
    register_verl_policy_loss()  # idempotent
    loss_fn = get_policy_loss_fn("sao")
    config = OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": 0.8, "clip_ratio_high": 3.0, "clip_ratio_c": 3.0, "global_batch_info": {}}
    )
    log_prob = torch.log(torch.tensor([[0.1, 0.5, 2.0, 5.0], [1.0, 1.0, 1.0, 1.0]])).requires_grad_()
    old_log_prob = torch.zeros(2, 4)
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0], [0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    loss, metrics = loss_fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=config,
        rollout_is_weights=None,
    )
    expected, _ = sao_policy_loss(log_prob, old_log_prob, advantages, mask, CODING)
    assert loss.item() == pytest.approx(expected.item())
    assert metrics["actor/sao_masked_fraction"] == pytest.approx(2 / 6)
    loss.backward()
    assert log_prob.grad is not None
    assert log_prob.grad[0, 0] == 0 and log_prob.grad[0, 3] == 0  # masked on both sides


def test_verl_hook_folds_importance_weights_back_into_the_behaviour_policy() -> None:
    require_trainer("verl", "verl", "verl")
    from omegaconf import OmegaConf

    from corral.trainer_adapters.sao.hooks import verl_sao_policy_loss

    config = OmegaConf.create({"clip_ratio_low": 0.8, "clip_ratio_high": 3.0, "global_batch_info": {}})
    # pi_theta / pi_old = 1, but pi_old / pi_rollout = 5: against the rollout the ratio is 5, out of the band.
    log_prob = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    weights = torch.tensor([[5.0, 1.0]])
    _, metrics = verl_sao_policy_loss(
        torch.zeros(1, 2), log_prob, torch.ones(1, 2), mask, "token-mean", config, rollout_is_weights=weights
    )
    assert metrics["actor/sao_masked_above_fraction"] == 0.5


@pytest.fixture
def miles_stand_in(monkeypatch):
    """Stand-ins for the two Miles helpers the loss calls (Miles cannot be installed here): one
    unpacked sequence, logprobs of its response tokens from [1, T, V] logits, and the loss masks
    as given. Real Miles also handles packing and context parallelism in them."""

    def get_log_probs_and_entropy(
        logits,
        *,
        args,
        unconcat_tokens,
        total_lengths,
        response_lengths,
        with_entropy,
        entropy_requires_grad,
        max_seq_lens,
    ):
        out, start = [], 0
        for tokens, total, response in zip(unconcat_tokens, total_lengths, response_lengths):
            seq_logits = logits[0, start : start + total]
            logprobs = torch.log_softmax(seq_logits[:-1], dim=-1).gather(-1, tokens[1:, None]).squeeze(-1)
            out.append(logprobs[total - response - 1 :])
            start += total
        return {"log_probs": out}

    def get_local_response_loss_masks(total_lengths, response_lengths, loss_masks, qkv_format, max_seq_lens):
        return [torch.as_tensor(m, dtype=torch.float32) for m in loss_masks]

    modules = {
        "miles": types.ModuleType("miles"),
        "miles.backends": types.ModuleType("miles.backends"),
        "miles.backends.training_utils": types.ModuleType("miles.backends.training_utils"),
        "miles.backends.training_utils.cp_utils": types.ModuleType("miles.backends.training_utils.cp_utils"),
        "miles.backends.training_utils.loss_hub": types.ModuleType("miles.backends.training_utils.loss_hub"),
        "miles.backends.training_utils.loss_hub.logit_processors": types.ModuleType(
            "miles.backends.training_utils.loss_hub.logit_processors"
        ),
    }
    modules["miles.backends.training_utils.cp_utils"].get_local_response_loss_masks = get_local_response_loss_masks
    modules[
        "miles.backends.training_utils.loss_hub.logit_processors"
    ].get_log_probs_and_entropy = get_log_probs_and_entropy
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_miles_custom_loss_uses_rollout_logprobs_and_sample_means(miles_stand_in) -> None:
    torch.manual_seed(0)
    tokens = torch.tensor([3, 1, 4, 1, 5])  # prompt 3 1, response 4 1 5
    logits = torch.randn(1, 5, 8, requires_grad=True)
    current = torch.log_softmax(logits[0, :-1], -1).gather(-1, tokens[1:, None]).squeeze(-1)[1:]
    rollout = current.detach() - torch.log(torch.tensor([1.0, 10.0, 1.0]))  # ratio 10 on the middle token
    args = argparse.Namespace(qkv_format="thd")
    batch = {
        "unconcat_tokens": [tokens],
        "total_lengths": [5],
        "response_lengths": [3],
        "loss_masks": [[1, 1, 1]],
        "rollout_log_probs": [rollout],
        "advantages": [torch.ones(3)],
    }
    loss, metrics = miles_sao_loss(args, batch, logits, lambda per_token: per_token.sum() / 3)
    assert loss.item() == pytest.approx(-2.0 / 3)  # two kept tokens with ratio 1, advantage 1
    assert metrics["sao_masked_above_fraction"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert logits.grad is not None
    with pytest.raises(ValueError, match="rollout_log_probs"):
        miles_sao_loss(args, {**batch, "rollout_log_probs": None}, logits, lambda t: t.sum())
