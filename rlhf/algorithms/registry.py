"""The tables of advantage estimators and policy losses: name -> pure function + properties.

Everything that depends on the choice of estimator or loss reads these tables: the config's
allowed values (``rlhf.config.schema``), whether a critic is built, whether
``rollout.n_samples_per_prompt >= 2`` is required, which samples a non-finite reward drops.
Adding an estimator is one ``Estimator(...)`` row plus its pure function; adding a policy
loss is one ``PolicyLoss(...)`` row.

Conventions (one rule each, see ``docs/algorithms.md`` for the reasoning):

- **KL in the reward** (``algorithm.kl_in_reward=true``) enters where the estimator takes its
  rewards. Token-level estimators (``gae``, ``reinforce_pp``, ``reinforce_pp_baseline``) get
  ``-kl_coef * kl_t`` on every action token, so token ``t`` pays for the KL of itself and of
  the tokens after it (causal credit). Sequence-level estimators (``grpo``, ``dr_grpo``,
  ``rloo``) see one number per sample, so the penalty is the sample's summed KL subtracted
  from its score before the group comparison. With ``gamma=1`` both give a sample the same
  total penalty.
- **Variance** is always the unbiased (N-1) estimate: group standard deviations (GRPO) and
  global whitening (``masked_whiten``) alike, as ``torch.std``.
- **A group of one sample** gets advantage 0 from ``grpo``/``dr_grpo``/``reinforce_pp_baseline``
  (no baseline to compare with); ``rloo`` refuses it (its leave-one-out baseline is undefined).
  The config refuses group estimators with ``n_samples_per_prompt < 2`` up front.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.algorithms.advantages import (
    broadcast_sequence_advantages,
    gae,
    grpo_advantages,
    reinforce_pp_baseline,
    reinforce_pp_returns,
    rloo_advantages,
    token_level_rewards,
)
from rlhf.algorithms.losses import gspo_policy_loss, ppo_policy_loss
from rlhf.algorithms.masking import segment_sum

__all__ = [
    "ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "Estimator",
    "PolicyLoss",
    "group_estimator_names",
]


@dataclass(frozen=True)
class AdvantageInputs:
    """What every estimator may read. ``T`` = total tokens, ``B`` = samples.

    Attributes:
        scores: ``[B]`` sequence scores (reward function / model, after shaping).
        action_mask: ``[T]`` bool, True on policy-generated tokens.
        cu_seqlens: ``[B + 1]`` sample boundaries.
        group_ids: ``[B]`` samples of one prompt share an id.
        kl: ``[T]`` per-token KL(actor || reference) to fold into the reward, or None
            (no reference, or the KL is a loss term).
        values: ``[T]`` critic values, or None without a critic.
        kl_coef, gamma, lam: the ``algorithm.*`` coefficients.
    """

    scores: torch.Tensor
    action_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    group_ids: torch.Tensor
    kl: torch.Tensor | None = None
    values: torch.Tensor | None = None
    kl_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95


EstimatorFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Estimator:
    """One row of :data:`ESTIMATORS`.

    Attributes:
        name: the ``algorithm.advantage`` value.
        fn: ``AdvantageInputs -> (advantages [T], returns [T] or None)``, 0 off the action mask.
        uses_critic: needs critic values (a critic group is built and trained).
        compares_group: compares the samples of one prompt (needs ``n_samples_per_prompt >= 2``;
            a sample dropped for a non-finite reward takes its whole group with it).
        summary: one line for docs and error messages.
    """

    name: str
    fn: EstimatorFn
    uses_critic: bool
    compares_group: bool
    summary: str


def _sequence_kl_scores(x: AdvantageInputs) -> torch.Tensor:
    """Scores minus the sample's summed KL penalty: how sequence estimators see KL in reward."""
    scores = x.scores.float()
    if x.kl is None or x.kl_coef == 0:
        return scores
    return scores - x.kl_coef * segment_sum(x.kl, x.cu_seqlens, x.action_mask)


def _token_rewards(x: AdvantageInputs, scores: torch.Tensor) -> torch.Tensor:
    return token_level_rewards(scores, x.kl, x.kl_coef, x.action_mask, x.cu_seqlens)


def _gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.values is None:
        raise ValueError("algorithm.advantage=gae needs critic values; the critic group is missing")
    rewards = _token_rewards(x, x.scores.float())
    return gae(x.values, rewards, x.action_mask, x.cu_seqlens, gamma=x.gamma, lam=x.lam)


def _reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    rewards = _token_rewards(x, x.scores.float())
    return reinforce_pp_returns(rewards, x.action_mask, x.cu_seqlens, x.gamma), None


def _reinforce_pp_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    rewards = _token_rewards(x, reinforce_pp_baseline(x.scores.float(), x.group_ids))
    return reinforce_pp_returns(rewards, x.action_mask, x.cu_seqlens, x.gamma), None


def _sequence_estimator(seq_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> EstimatorFn:
    def fn(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq_adv = seq_fn(_sequence_kl_scores(x), x.group_ids)
        return broadcast_sequence_advantages(seq_adv, x.action_mask, x.cu_seqlens), None

    return fn


ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("gae", _gae, True, False, "PPO: GAE over per-token rewards with a critic"),
        Estimator(
            "grpo",
            _sequence_estimator(grpo_advantages),
            False,
            True,
            "GRPO: (score - group mean) / group std, broadcast to the sample's tokens",
        ),
        Estimator(
            "dr_grpo",
            _sequence_estimator(lambda s, g: grpo_advantages(s, g, scale_by_std=False)),
            False,
            True,
            "Dr. GRPO: score - group mean (no std scaling)",
        ),
        Estimator(
            "rloo",
            _sequence_estimator(rloo_advantages),
            False,
            True,
            "RLOO: score - mean of the other samples of the group",
        ),
        Estimator(
            "reinforce_pp",
            _reinforce_pp,
            False,
            False,
            "REINFORCE++: discounted per-token returns, globally whitened",
        ),
        Estimator(
            "reinforce_pp_baseline",
            _reinforce_pp_baseline,
            False,
            True,
            "REINFORCE++-baseline: group-mean baseline, then per-token returns, globally whitened",
        ),
    )
}


def group_estimator_names() -> tuple[str, ...]:
    """Names of the estimators that compare the samples of one prompt."""
    return tuple(name for name, e in ESTIMATORS.items() if e.compares_group)


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """One row of :data:`POLICY_LOSSES`.

    Attributes:
        name: the ``algorithm.policy_loss`` value.
        fn: ``(logprobs, old_logprobs, advantages, mask, cu_seqlens, *, clip_eps_low,
            clip_eps_high, dual_clip, aggregation, weights) -> (loss, stats)``.
        supports_dual_clip: accepts a ``dual_clip`` constant.
        summary: one line for docs and error messages.
    """

    name: str
    fn: PolicyLossFn
    supports_dual_clip: bool
    summary: str


POLICY_LOSSES: dict[str, PolicyLoss] = {
    p.name: p
    for p in (
        PolicyLoss("ppo", ppo_policy_loss, True, "token-level clipped ratio (PPO; DAPO clip-higher)"),
        PolicyLoss(
            "gspo",
            gspo_policy_loss,
            False,
            "sequence-level ratio (geometric mean of token ratios) with sequence clipping (GSPO)",
        ),
    )
}
