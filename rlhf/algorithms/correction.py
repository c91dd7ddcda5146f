"""Training-inference mismatch correction (rollout correction): TIS and MIS weights.

The engines sample with their own numerics (vLLM kernels, bf16, other batch shapes), so the
behaviour policy ``pi_rollout`` that produced a token is not exactly the trainer's
``pi_old`` even with the same weights. The PPO ratio is taken against ``pi_old``; these
weights correct the remaining ``pi_old / pi_rollout`` gap (Yao et al. 2025, "Your efficient
RL framework secretly brings you off-policy RL training"; verl's rollout correction):

- ``tis`` (truncated importance sampling): ``w = min(rho, cap)``.
- ``mis`` (masked importance sampling, IcePop): ``w = rho`` where ``low <= rho <= high``,
  else 0; a zero weight also removes the token from the loss and its normaliser.

``rho`` is per token (``level="token"``), per sequence as the product of its token ratios
(``"sequence"``) or per sequence as their geometric mean (``"geometric"``, length-normalised,
so long samples are not truncated or masked for their length alone). A sequence ratio
covers every action token of the sample, all turns of a multi-turn sample included.
Weights are constants for the gradient.

Layout as in ``rlhf.algorithms``: per-token ``[T]``, ``cu_seqlens`` ``[B + 1]``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rlhf.algorithms.masking import _as_bool, masked_mean, segment_ids, segment_sum

__all__ = ["CORRECTION_LEVELS", "CORRECTION_MODES", "mismatch_stats", "rollout_correction_weights"]

CORRECTION_MODES = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CorrectionLevel = Literal["token", "sequence", "geometric"]

# exp(20) ~ 5e8: far beyond any cap, and finite in fp32 for the metrics.
_LOG_RATIO_BOUND = 20.0


def _log_rho(
    log_ratio: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, level: str
) -> torch.Tensor:
    if level == "token":
        return log_ratio
    per_sample = segment_sum(log_ratio, cu_seqlens, mask)
    if level == "geometric":
        per_sample = per_sample / segment_sum(mask.long(), cu_seqlens).clamp(min=1).to(log_ratio.dtype)
    elif level != "sequence":
        raise ValueError(
            f"unknown correction level {level!r}; expected one of {', '.join(CORRECTION_LEVELS)}"
        )
    return per_sample[segment_ids(cu_seqlens.to(mask.device), mask.shape[0])]


def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: Literal["tis", "mis"],
    level: CorrectionLevel = "token",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token policy-loss weights that correct for the engine/trainer mismatch.

    Args:
        old_logprobs (torch.Tensor): ``[T]`` trainer logprobs of the sampled tokens before the update.
        rollout_logprobs (torch.Tensor): ``[T]`` the engine's logprobs of the same tokens.
        action_mask (torch.Tensor): ``[T]`` bool, True on policy-generated tokens.
        cu_seqlens (torch.Tensor): ``[B + 1]`` integer cumulative sequence lengths.
        mode (Literal["tis", "mis"]): truncate (``tis``) or mask (``mis``).
        level (CorrectionLevel): ``token``, ``sequence`` (product) or ``geometric`` (mean). Default "token".
        tis_cap (float): TIS cap ``C >= 1``. Default 2.0.
        mis_low (float): MIS lower bound, ``0 <= low < 1``. Default 0.5.
        mis_high (float): MIS upper bound, ``> 1``. Default 2.0.

    Returns:
        tuple[torch.Tensor, dict[str, float]]: ``[T]`` float32 weights (0 off the action mask; for
        ``mis`` also 0 where rejected) and stats over action tokens: ``truncated_fraction``
        (``tis``) or ``masked_fraction`` (``mis``), ``weight_mean``.
    """
    if mode == "tis":
        if tis_cap < 1.0:
            raise ValueError(
                f"TIS cap must be >= 1 (a cap below 1 down-weights on-policy tokens), got {tis_cap}"
            )
    elif mode == "mis":
        if not (0.0 <= mis_low < 1.0 < mis_high):
            raise ValueError(
                f"MIS bounds must satisfy 0 <= low < 1 < high, got low={mis_low} high={mis_high}"
            )
    else:
        raise ValueError(f"unknown correction mode {mode!r}; expected 'tis' or 'mis'")
    mask = _as_bool(action_mask)
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, old_logprobs.float() - rollout_logprobs.float(), zero)
    log_rho = _log_rho(log_ratio, mask, cu_seqlens, level).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    rho = torch.exp(log_rho)
    if mode == "tis":
        hit = rho > tis_cap
        weights = torch.where(mask, rho.clamp(max=tis_cap), zero)
        name = "truncated_fraction"
    else:
        hit = (rho < mis_low) | (rho > mis_high)
        weights = torch.where(mask & ~hit, rho, zero)
        name = "masked_fraction"
    stats = {name: float(masked_mean(hit.float(), mask)), "weight_mean": float(masked_mean(weights, mask))}
    return weights, stats


def mismatch_stats(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> dict[str, float]:
    """How far the engine's policy is from the trainer's, over action tokens.

    Tokens were sampled from ``pi_rollout``, so with ``log r = old - rollout``:
    ``kl_k1 = mean(-log r)`` and ``kl_k3 = mean(r - 1 - log r)`` both estimate
    ``KL(pi_rollout || pi_old)`` (k3: non-negative, lower variance).
    """
    mask = _as_bool(action_mask)
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_r = torch.where(mask, old_logprobs.float() - rollout_logprobs.float(), zero)
    log_r = log_r.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return {
        "kl_k1": float(masked_mean(-log_r, mask)),
        "kl_k3": float(masked_mean(torch.expm1(log_r) - log_r, mask)),
    }
