"""Per-token KL-divergence estimators (Schulman, "Approximating KL Divergence", 2020)."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["KLKind", "kl_estimator"]

KLKind = Literal["k1", "k2", "k3"]
_LOG_RATIO_BOUND = 20.0


def kl_estimator(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: KLKind = "k3",
    clamp: float | None = None,
    action_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-sample estimate of ``KL(pi || ref)`` at each token sampled from ``pi``.

    With ``log r = logprobs - ref_logprobs`` (``r = pi / ref``):

    - ``k1 = log r``: unbiased, high variance, can be negative.
    - ``k2 = 0.5 * (log r) ** 2``: biased, low variance, always >= 0.
    - ``k3 = exp(-log r) - 1 + log r = (ref / pi) - 1 - log(ref / pi)``: unbiased, low variance,
      always >= 0.

    Args:
        logprobs (torch.Tensor): log-probabilities of the sampled tokens under the policy, any shape
            (packed ``[T]`` in this project).
        ref_logprobs (torch.Tensor): same shape, under the reference policy.
        kind (Literal["k1", "k2", "k3"]): which estimator. Default "k3".
        clamp (float | None): if given, the estimate is clamped to ``[-clamp, clamp]`` (verl and
            OpenRLHF use 10): one token where the policies disagree strongly (log-ratio -15 gives
            k3 = 3.3e6) would otherwise swamp the reward and the gradient. The log-ratio is first
            bounded to ``[-20, 20]`` (as verl does) so that ``exp`` stays finite and the gradient
            of a clamped token is 0, not NaN. Default None (no clamp).
        action_mask (torch.Tensor | None): bool, same shape; where false the output is exactly 0,
            whatever the inputs hold there (e.g. NaN at the first token of a sample). Default None.

    Returns:
        torch.Tensor: per-token estimate, same shape as ``logprobs``.
    """
    log_ratio = logprobs - ref_logprobs
    if action_mask is not None:
        # Sanitize before exp so that garbage at masked positions cannot produce inf/NaN gradients.
        log_ratio = torch.where(action_mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    if clamp is not None:
        log_ratio = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown KL estimator kind {kind!r}; expected 'k1', 'k2' or 'k3'")
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl
