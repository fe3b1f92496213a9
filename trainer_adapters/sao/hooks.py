"""The SAO loss where trainers take custom losses: veRL's policy-loss registry and Miles'
`--custom-loss-function-path`. Each trainer is imported only when its hook is used.

veRL (0.9.1): `register_verl_policy_loss()` registers "sao" in `verl.trainer.ppo.core_algos`'s
registry; select it with `actor_rollout_ref.actor.policy_loss.loss_mode=sao`. The band comes from
`actor_rollout_ref.actor.clip_ratio_low` / `clip_ratio_high` (eps_low / eps_high: 0.8 / 3.0 for the
coding preset). The behaviour policy must be the rollout's own logprobs: veRL hands the loss
`old_log_prob`, which is the rollout's logprobs when the trainer skips recomputing them; when it
recomputes them (veRL's default "decoupled" mode) and passes token-level importance weights
π_old/π_rollout as `rollout_is_weights` (rollout correction with token IS, no truncation), the hook
folds them back in: log π_rollout = old_log_prob - log(weights). Aggregation is veRL's own
`agg_loss` with the configured `loss_agg_mode` ("token-mean" matches SAO's token denominator).

Miles: `--loss-type custom_loss --custom-loss-function-path corral.trainer_adapters.sao.hooks.miles_sao_loss`
with `--use-rollout-logprobs`-style data (the batch's rollout_log_probs are the behaviour policy).
The band comes from `args.sao_eps_low` / `args.sao_eps_high` when set, else the coding preset.
Miles' `sum_of_sample_mean` aggregates (each sample's mean over its loss mask), so the
denominator is per sequence there.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch

from corral.trainer_adapters.sao.loss import CODING, SAOConfig, sao_token_losses

VERL_LOSS_NAME = "sao"


def verl_sao_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL's PolicyLossFn signature (called with keywords by veRL's actor)."""
    from verl.trainer.ppo.core_algos import agg_loss

    behaviour = old_log_prob
    if rollout_is_weights is not None:
        behaviour = old_log_prob - torch.log(rollout_is_weights.clamp(min=1e-12))
    sao = SAOConfig(
        eps_low=_config_value(config, "clip_ratio_low", CODING.eps_low),
        eps_high=_config_value(config, "clip_ratio_high", CODING.eps_high),
    )
    per_token, _, metrics = sao_token_losses(log_prob, behaviour.detach(), advantages, response_mask, sao)
    batch_info = _config_value(config, "global_batch_info", None) or {}
    loss = agg_loss(per_token, response_mask, loss_agg_mode, **dict(batch_info))
    return loss, {f"actor/sao_{name}": value for name, value in metrics.items()}


def register_verl_policy_loss() -> Callable[..., Any]:
    """Registers the SAO loss with veRL as "sao" (idempotent) and returns it."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    if POLICY_LOSS_REGISTRY.get(VERL_LOSS_NAME) is not verl_sao_policy_loss:
        register_policy_loss(VERL_LOSS_NAME)(verl_sao_policy_loss)
    return verl_sao_policy_loss


def miles_sao_loss(
    args: Namespace,
    batch: dict[str, Any],
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Miles' LossFunction signature: current logprobs from the logits with Miles' own helper
    (it handles packing and parallelism), the rollout's logprobs as the behaviour policy."""
    from miles.backends.training_utils.cp_utils import get_local_response_loss_masks
    from miles.backends.training_utils.loss_hub.logit_processors import get_log_probs_and_entropy

    if batch.get("rollout_log_probs") is None:
        raise ValueError("the SAO loss needs the rollouts' logprobs (rollout_log_probs) in the batch")
    max_seq_lens = batch.get("max_seq_lens")
    log_probs = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=False,
        entropy_requires_grad=False,
        max_seq_lens=max_seq_lens,
    )["log_probs"]
    masks = get_local_response_loss_masks(
        batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], args.qkv_format, max_seq_lens
    )
    current = torch.cat(log_probs, dim=0)
    behaviour = torch.cat([lp.detach() for lp in batch["rollout_log_probs"]], dim=0).to(current.device)
    advantages = torch.cat([a.detach() for a in batch["advantages"]], dim=0).to(current.device)
    mask = torch.cat(masks, dim=0).to(current.device)
    sao = SAOConfig(
        eps_low=getattr(args, "sao_eps_low", None) or CODING.eps_low,
        eps_high=getattr(args, "sao_eps_high", None) or CODING.eps_high,
    )
    per_token, _, metrics = sao_token_losses(current, behaviour, advantages, mask, sao)
    loss = sum_of_sample_mean(per_token)
    return loss, {"loss": loss.detach(), **{f"sao_{k}": torch.tensor(v) for k, v in metrics.items()}}


def _config_value(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        value = getter(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value
