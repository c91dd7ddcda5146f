"""Training losses over unpadded (packed) samples: PPO policy/value, SFT, DPO, reward model.

Per-token inputs are ``[T]`` (samples concatenated), ``cu_seqlens`` is ``[B + 1]``, and the mask
(``action_mask`` or ``loss_mask``) selects the tokens that carry a loss. Inputs at unselected
positions are replaced by 0 *before* any arithmetic: ``torch.where`` alone would keep the forward
value finite but a NaN/inf there would still turn the backward pass into NaN (``0 * inf``).

Stats dictionaries hold detached 0-dim tensors (no host sync); call ``.item()`` when logging.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from rlhf.algorithms.masking import (
    _as_bool,
    masked_mean,
    masked_var,
    segment_ids,
    segment_mean,
    segment_sum,
)

__all__ = [
    "Aggregation",
    "aggregate_loss",
    "dpo_loss",
    "gspo_policy_loss",
    "pairwise_rm_loss",
    "ppo_policy_loss",
    "sft_loss",
    "value_loss",
]

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


# Log-ratios are bounded to [-20, 20] before exp, in the PPO loss and in the approx_kl / ratio_mean
# statistics: exp(>88) is inf in fp32, and one such token made the logged statistics inf while the
# loss stayed finite. e^20 ~ 5e8 is far outside any clip range, so nothing real is cut.
STAT_LOG_RATIO_BOUND = 20.0


def _select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    aggregation: Aggregation = "token_mean",
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - ``"token_mean"``: mean over all selected tokens of the batch (long samples weigh more).
    - ``"seq_mean_token_mean"``: per-sample mean over its selected tokens, then mean over samples
      (the original GRPO objective; every sample weighs the same).
    - ``"seq_mean_token_sum"``: per-sample sum over its selected tokens, then mean over samples
      (Dr. GRPO-style, no length normalization).

    Samples without any selected token are excluded from the mean over samples; an empty
    selection gives 0.

    Args:
        per_token_loss (torch.Tensor): ``[T]`` loss per token.
        mask (torch.Tensor): ``[T]`` bool, tokens that carry a loss; the others are ignored (even NaN).
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        aggregation (Aggregation): reduction mode. Default "token_mean".

    Returns:
        torch.Tensor: 0-dim loss.
    """
    mask = _as_bool(mask)
    if aggregation == "token_mean":
        return masked_mean(per_token_loss, mask)
    if aggregation == "seq_mean_token_mean":
        per_sample = segment_mean(per_token_loss, cu_seqlens, mask)
    elif aggregation == "seq_mean_token_sum":
        per_sample = segment_sum(per_token_loss, cu_seqlens, mask)
    else:
        raise ValueError(
            f"unknown aggregation {aggregation!r}; expected 'token_mean', 'seq_mean_token_mean' "
            "or 'seq_mean_token_sum'"
        )
    has_tokens = segment_sum(mask.long(), cu_seqlens) > 0
    return masked_mean(per_sample, has_tokens)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss (PPO, Schulman et al. 2017), with DAPO clip-higher and dual clip.

    With ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A`` per token::

        loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high))

    Dual clip (Ye et al. 2020): for ``A < 0`` the loss is additionally capped at
    ``-A * dual_clip``, so that a huge ratio on a bad action cannot produce an unbounded update.

    Args:
        logprobs (torch.Tensor): ``[T]`` log-probabilities of the taken tokens under the current policy.
        old_logprobs (torch.Tensor): ``[T]`` same under the rollout (behaviour) policy.
        advantages (torch.Tensor): ``[T]`` per-token advantages.
        action_mask (torch.Tensor): ``[T]`` bool, True on policy-generated tokens.
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        clip_eps_low (float): lower clip range, ratio >= 1 - clip_eps_low. Default 0.2.
        clip_eps_high (float): upper clip range, ratio <= 1 + clip_eps_high. Default 0.2.
        dual_clip (float | None): dual-clip constant ``c > 1``, or None to disable. Default None.
        aggregation (Aggregation): see :func:`aggregate_loss`. Default "token_mean".
        weights (torch.Tensor | None): ``[T]`` per-token multipliers of the loss (rollout-correction
            importance weights, treated as constants), or None for 1. Default None.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: the 0-dim loss and detached stats over action
        tokens: ``clip_fraction`` (tokens where the clipped term is the active one),
        ``dual_clip_fraction`` (only with ``dual_clip``), ``approx_kl`` (k3 estimate of
        ``KL(old || new)``), ``ratio_mean``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = _as_bool(action_mask)
    log_ratio = _select(logprobs - old_logprobs, mask)
    adv = _select(advantages, mask)
    # exp(>88) overflows fp32 and a zero advantage times inf is NaN; such tokens are clipped anyway.
    bounded = log_ratio.clamp(-STAT_LOG_RATIO_BOUND, STAT_LOG_RATIO_BOUND)
    ratio = torch.exp(bounded)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    stats: dict[str, torch.Tensor] = {}
    if dual_clip is not None:
        capped = torch.minimum(per_token, -adv * dual_clip)
        dual_active = (adv < 0) & (capped < per_token)
        per_token = torch.where(adv < 0, capped, per_token)
        stats["dual_clip_fraction"] = masked_mean(dual_active.to(ratio.dtype), mask).detach()
    if weights is not None:
        per_token = per_token * _select(weights.detach(), mask)
    loss = aggregate_loss(per_token, mask, cu_seqlens, aggregation)

    with torch.no_grad():
        stats["clip_fraction"] = masked_mean((clipped > unclipped).to(ratio.dtype), mask)
        # Samples come from the old policy, so k3 with r = new/old estimates KL(old || new).
        stats["approx_kl"] = masked_mean(torch.expm1(bounded) - bounded, mask)
        stats["ratio_mean"] = masked_mean(ratio, mask)
    return loss, stats


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    dual_clip: float | None = None,
    aggregation: Aggregation = "seq_mean_token_mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization loss (GSPO, Zheng et al. 2025).

    The importance ratio is per sequence and length-normalised, the geometric mean of the
    token ratios over the sample's action tokens (all of its turns)::

        s_i = exp(mean_{t in actions(i)} (logprobs_t - old_logprobs_t))

    and the clip acts on ``s_i``. The gradient is the GSPO-token form: on token ``t`` the ratio is
    ``sg[s_i] * pi(y_t) / sg[pi(y_t)]``, equal to ``s_i`` in value, so with one advantage per
    sample it equals the gradient of the sequence objective; per-token advantages also work::

        loss_t = max(-A_t * s_i, -A_t * clip(s_i, 1 - clip_eps_low, 1 + clip_eps_high))

    The defaults are the paper's (clip 3e-4 / 4e-4, mean over tokens then over sequences).

    Args:
        logprobs (torch.Tensor): ``[T]`` log-probabilities under the current policy.
        old_logprobs (torch.Tensor): ``[T]`` same under the behaviour policy.
        advantages (torch.Tensor): ``[T]`` per-token advantages.
        action_mask (torch.Tensor): ``[T]`` bool, the tokens that carry a loss.
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        clip_eps_low (float): lower clip range of the sequence ratio. Default 3e-4.
        clip_eps_high (float): upper clip range of the sequence ratio. Default 4e-4.
        dual_clip (float | None): not defined for GSPO; must be None.
        aggregation (Aggregation): see :func:`aggregate_loss`. Default "seq_mean_token_mean".
        weights (torch.Tensor | None): ``[T]`` per-token loss multipliers (rollout correction),
            treated as constants, or None. Default None.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: the 0-dim loss and detached stats:
        ``clip_fraction`` (share of action tokens whose sequence ratio is clipped),
        ``approx_kl`` (token k3 estimate of ``KL(old || new)``), ``ratio_mean`` (mean
        sequence ratio over samples with actions).
    """
    if dual_clip is not None:
        raise ValueError("gspo_policy_loss has no dual clip; set algorithm.dual_clip=0")
    mask = _as_bool(action_mask)
    log_ratio = _select(logprobs - old_logprobs, mask)
    adv = _select(advantages, mask)
    counts = segment_sum(mask.long(), cu_seqlens)
    seq_log_ratio = segment_sum(log_ratio, cu_seqlens) / counts.clamp(min=1).to(log_ratio.dtype)
    ids = segment_ids(cu_seqlens.to(mask.device), mask.shape[0])
    # Value s_i on every token, gradient of log pi_t: the GSPO-token construction.
    token_log_s = _select(logprobs - logprobs.detach(), mask) + seq_log_ratio.detach()[ids]
    # Overflow guard at verl's bound (e^10 ~ 2e4, far outside any clip range).
    s = torch.exp(token_log_s.clamp(max=10.0))
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * _select(weights.detach(), mask)
    loss = aggregate_loss(per_token, mask, cu_seqlens, aggregation)
    with torch.no_grad():
        has_actions = counts > 0
        bounded = log_ratio.clamp(-STAT_LOG_RATIO_BOUND, STAT_LOG_RATIO_BOUND)
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).to(s.dtype), mask),
            "approx_kl": masked_mean(torch.expm1(bounded) - bounded, mask),
            "ratio_mean": masked_mean(
                torch.exp(seq_log_ratio.clamp(-STAT_LOG_RATIO_BOUND, STAT_LOG_RATIO_BOUND)), has_actions
            ),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    clip_eps: float | None = 0.2,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss.

    ``loss_t = 0.5 * max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2)``; with
    ``clip_eps=None`` it is the plain ``0.5 * (v - R)^2``.

    Args:
        values (torch.Tensor): ``[T]`` current critic values.
        old_values (torch.Tensor): ``[T]`` critic values at rollout time.
        returns (torch.Tensor): ``[T]`` return targets (e.g. from :func:`gae`).
        action_mask (torch.Tensor): ``[T]`` bool, True on policy-generated tokens.
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        clip_eps (float | None): clip range around ``old_values``, None to disable. Default 0.2.
        aggregation (Aggregation): see :func:`aggregate_loss`. Default "token_mean".

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: the 0-dim loss and detached stats over action
        tokens: ``clip_fraction`` (tokens where the clipped term is the larger one), ``values_mean``,
        ``explained_variance`` (``1 - Var[R - v] / Var[R]``).
    """
    mask = _as_bool(action_mask)
    v = _select(values, mask)
    ret = _select(returns, mask)
    unclipped = (v - ret).square()
    stats: dict[str, torch.Tensor] = {}
    if clip_eps is None:
        per_token = 0.5 * unclipped
        stats["clip_fraction"] = unclipped.new_zeros(())
    else:
        old = _select(old_values, mask)
        # Clamp v itself (not old + clamp(v - old)) so that in-range values stay bit-identical to v.
        v_clipped = torch.clamp(v, old - clip_eps, old + clip_eps)
        clipped = (v_clipped - ret).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        stats["clip_fraction"] = masked_mean((clipped > unclipped).to(v.dtype), mask).detach()
    loss = aggregate_loss(per_token, mask, cu_seqlens, aggregation)

    with torch.no_grad():
        stats["values_mean"] = masked_mean(v, mask)
        var_ret = masked_var(ret, mask)
        stats["explained_variance"] = 1.0 - masked_var(ret - v, mask) / var_ret.clamp(min=1e-8)
    return loss, stats


def sft_loss(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    aggregation: Aggregation = "token_mean",
) -> torch.Tensor:
    """Negative log-likelihood over the ``loss_mask`` tokens.

    Args:
        logprobs (torch.Tensor): ``[T]`` log-probabilities of the target tokens.
        loss_mask (torch.Tensor): ``[T]`` bool, tokens to train on (typically the responses).
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        aggregation (Aggregation): see :func:`aggregate_loss`. Default "token_mean".

    Returns:
        torch.Tensor: 0-dim loss.
    """
    mask = _as_bool(loss_mask)
    return aggregate_loss(-_select(logprobs, mask), mask, cu_seqlens, aggregation)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid DPO loss (Rafailov et al. 2023) with conservative label smoothing (cDPO).

    The smoothing is cDPO's (Mitchell 2023), as OpenRLHF's ``label_smoothing``; TRL 1.16's
    ``sigmoid`` loss has none, so it matches TRL only with ``label_smoothing=0``.

    With ``h = (pi_c - pi_r) - (ref_c - ref_r)`` (sequence log-probabilities summed over response
    tokens)::

        loss = mean(-(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta * h))

    Args:
        policy_chosen_logps (torch.Tensor): ``[P]`` policy log-probabilities of the chosen responses.
        policy_rejected_logps (torch.Tensor): ``[P]`` same for the rejected responses.
        ref_chosen_logps (torch.Tensor): ``[P]`` reference-model log-probabilities, chosen.
        ref_rejected_logps (torch.Tensor): ``[P]`` reference-model log-probabilities, rejected.
        beta (float): inverse temperature of the implicit reward. Default 0.1.
        label_smoothing (float): assumed probability in ``[0, 0.5]`` that a label is flipped. Default 0.

    Returns:
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]: the 0-dim loss, and the detached implicit
        rewards ``beta * (pi - ref)`` of the chosen and rejected responses, ``[P]`` each.
    """
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(
        -beta * logits
    )
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


def pairwise_rm_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bradley-Terry pairwise reward-model loss, ``-logsigmoid(r_c - r_r - margin).mean()``.

    Args:
        chosen_rewards (torch.Tensor): ``[P]`` scalar rewards of the chosen responses.
        rejected_rewards (torch.Tensor): ``[P]`` scalar rewards of the rejected responses.
        margin (torch.Tensor | None): ``[P]`` required reward gap (Llama 2), or None for 0. Default None.

    Returns:
        torch.Tensor: 0-dim loss.
    """
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()
