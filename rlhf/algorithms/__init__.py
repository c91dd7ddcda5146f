"""RL algorithms as pure torch functions over unpadded (packed) samples.

Importing this package needs only torch: no Ray, vLLM or DeepSpeed.
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
from rlhf.algorithms.kl import KLKind, kl_estimator
from rlhf.algorithms.losses import (
    Aggregation,
    aggregate_loss,
    dpo_loss,
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

__all__ = [
    "Aggregation",
    "KLKind",
    "aggregate_loss",
    "broadcast_sequence_advantages",
    "dpo_loss",
    "gae",
    "grpo_advantages",
    "kl_estimator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_rm_loss",
    "ppo_policy_loss",
    "reinforce_pp_baseline",
    "reinforce_pp_returns",
    "rloo_advantages",
    "segment_ids",
    "segment_mean",
    "segment_sum",
    "sft_loss",
    "token_level_rewards",
    "value_loss",
]
