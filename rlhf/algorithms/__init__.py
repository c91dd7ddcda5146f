"""RL algorithms as pure torch functions over unpadded (packed) samples.

Importing this package needs only torch: no Ray, vLLM or DeepSpeed. Estimators and policy
losses are the rows of ``rlhf.algorithms.registry``; its docstring and docs/algorithms.md
state the conventions (where the KL penalty goes, variance, groups of one).
"""

from rlhf.algorithms.advantages import (
    broadcast_sequence_advantages,
    gae,
    grpo_advantages,
    reinforce_pp_baseline,
    reinforce_pp_returns,
    rloo_advantages,
    token_level_rewards,
)
from rlhf.algorithms.correction import mismatch_stats, rollout_correction_weights
from rlhf.algorithms.kl import KLKind, kl_estimator
from rlhf.algorithms.losses import (
    Aggregation,
    aggregate_loss,
    dpo_loss,
    gspo_policy_loss,
    pairwise_rm_loss,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)
from rlhf.algorithms.masking import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    segment_ids,
    segment_mean,
    segment_sum,
)
from rlhf.algorithms.registry import ESTIMATORS, POLICY_LOSSES, AdvantageInputs, Estimator, PolicyLoss
from rlhf.algorithms.shaping import informative_samples, overlong_penalty

__all__ = [
    "ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "Aggregation",
    "Estimator",
    "PolicyLoss",
    "KLKind",
    "aggregate_loss",
    "broadcast_sequence_advantages",
    "dpo_loss",
    "gae",
    "gspo_policy_loss",
    "grpo_advantages",
    "informative_samples",
    "kl_estimator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_stats",
    "overlong_penalty",
    "pairwise_rm_loss",
    "ppo_policy_loss",
    "reinforce_pp_baseline",
    "reinforce_pp_returns",
    "rloo_advantages",
    "rollout_correction_weights",
    "segment_ids",
    "segment_mean",
    "segment_sum",
    "sft_loss",
    "token_level_rewards",
    "value_loss",
]
