"""Single-rollout asynchronous optimisation (SAO): learning from one rollout per prompt, as
corral streams them.

- `loss`: the SAO policy loss (token-level ratio against the rollout's own logprobs, strict
  double-sided ratio masking) and, for comparison, the PPO/DAPO decoupled-clip loss.
- `learner`: `StreamingLearner`, SAO updates from results as they arrive, with staleness
  tracking.
- `advantages`: token-level GAE that skips observation tokens (with a critic), a per-task running
  baseline (without one), and group-normalised advantages (GRPO/DAPO).
"""

from corral.trainer_adapters.sao.advantages import (
    RunningBaseline,
    gae_advantages,
    group_normalized_advantages,
    sequence_advantages_to_tokens,
)
from corral.trainer_adapters.sao.learner import (
    LearnerConfig,
    LearnerStats,
    StreamingLearner,
    UpdateReport,
    tiny_byte_lm_logprobs,
)
from corral.trainer_adapters.sao.loss import (
    CODING,
    MATHS,
    SAOConfig,
    clipped_policy_loss,
    sao_policy_loss,
    sao_token_losses,
)

__all__ = [
    "LearnerConfig",
    "LearnerStats",
    "StreamingLearner",
    "UpdateReport",
    "tiny_byte_lm_logprobs",
    "CODING",
    "MATHS",
    "RunningBaseline",
    "SAOConfig",
    "clipped_policy_loss",
    "gae_advantages",
    "group_normalized_advantages",
    "sao_policy_loss",
    "sao_token_losses",
    "sequence_advantages_to_tokens",
]
