"""The advantage step of the PPO loop: KL, advantages and policy-loss weights for a batch.

Thin glue: the estimator is the row of ``rlhf.algorithms.registry.ESTIMATORS`` named by
``algorithm.advantage``; rollout correction and the overlong filter become per-token
``loss_weights`` (``rlhf.algorithms.correction``).
"""

from __future__ import annotations

import torch

from rlhf.algorithms.correction import mismatch_stats, rollout_correction_weights
from rlhf.algorithms.kl import kl_estimator
from rlhf.algorithms.masking import masked_mean, masked_whiten, segment_ids
from rlhf.algorithms.registry import ESTIMATORS, AdvantageInputs
from rlhf.config.schema import AlgorithmConfig
from rlhf.data.packing import concat, unpack
from rlhf.data.types import FlatBatch, Sample


def per_token_kl(batch: FlatBatch, kind: str, clamp: float = 0.0) -> torch.Tensor | None:
    """KL(actor || reference) estimate on action tokens, 0 elsewhere; None without a reference."""
    if batch.ref_logprobs is None or batch.old_logprobs is None:
        return None
    kl = kl_estimator(batch.old_logprobs, batch.ref_logprobs, kind=kind, clamp=clamp or None)
    return torch.where(batch.action_mask, kl, torch.zeros_like(kl))


def compute_advantages(
    batch: FlatBatch, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Advantages [T] (and returns [T] for critic estimators) for ``algorithm.advantage``.

    With ``kl_in_reward`` the KL penalty is folded into the rewards the estimator reads;
    otherwise it is left to the policy loss (GRPO style).
    """
    mask = batch.action_mask
    kl = per_token_kl(batch, cfg.kl_kind, cfg.kl_clamp)
    inputs = AdvantageInputs(
        scores=batch.scores.float(),
        action_mask=mask,
        cu_seqlens=batch.cu_seqlens,
        group_ids=batch.group_ids,
        kl=kl if cfg.kl_in_reward else None,
        values=batch.values,
        kl_coef=cfg.kl_coef,
        gamma=cfg.gamma,
        lam=cfg.lam,
    )
    adv, returns = ESTIMATORS[cfg.advantage].fn(inputs)
    if cfg.normalize_advantages and bool(mask.any()):
        adv = masked_whiten(adv, mask)  # exactly 0 off the mask
    stats = {"advantages/mean": float(masked_mean(adv, mask)) if mask.any() else 0.0}
    if kl is not None and mask.any():
        stats["kl"] = float(masked_mean(kl, mask))
    return adv, returns, stats


def compute_loss_weights(
    batch: FlatBatch, truncated: torch.Tensor, cfg: AlgorithmConfig
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Per-token policy-loss weights [T] from rollout correction and the overlong filter.

    ``truncated`` is ``[B]`` bool (the sample hit ``max_new_tokens``). Returns None when
    neither is on (every action token weighs 1). The engine/trainer mismatch is measured
    whenever the engine's logprobs are there.
    """
    stats: dict[str, float] = {}
    mask = batch.action_mask
    have_rollout = batch.rollout_logprobs is not None and batch.old_logprobs is not None
    if have_rollout and mask.any():
        stats.update(
            {
                f"rollout_corr/{k}": v
                for k, v in mismatch_stats(batch.old_logprobs, batch.rollout_logprobs, mask).items()
            }
        )
    weights = None
    if cfg.rollout_correction != "none":
        if not have_rollout:
            raise ValueError(
                f"algorithm.rollout_correction={cfg.rollout_correction} needs the engines' logprobs of every "
                "sampled token (rollout_logprobs), and this batch has none: keep the engines returning "
                "logprobs (sampling logprobs=0) or set algorithm.rollout_correction=none"
            )
        weights, cstats = rollout_correction_weights(
            batch.old_logprobs,
            batch.rollout_logprobs,
            mask,
            batch.cu_seqlens,
            mode=cfg.rollout_correction,
            level=cfg.rollout_correction_level,
            tis_cap=cfg.tis_cap,
            mis_low=cfg.mis_low,
            mis_high=cfg.mis_high,
        )
        stats.update({f"rollout_corr/{k}": v for k, v in cstats.items()})
    if cfg.overlong_filter:
        if weights is None:
            weights = mask.float()
        keep = ~truncated.bool()[segment_ids(batch.cu_seqlens, batch.num_tokens)]
        weights = torch.where(keep, weights, torch.zeros_like(weights))
        stats["rollout/overlong_filtered"] = float(truncated.float().mean()) if truncated.numel() else 0.0
    return weights, stats


def advantage_step(samples: list[Sample], cfg: AlgorithmConfig) -> dict[str, float]:
    """Compute advantages (returns) and loss weights for ``samples`` in place; returns stats."""
    batch = concat(samples)
    adv, returns, stats = compute_advantages(batch, cfg)
    for s, a in zip(samples, unpack(adv, batch.cu_seqlens), strict=True):
        s.advantages = a.float()
    if returns is not None:
        for s, r in zip(samples, unpack(returns, batch.cu_seqlens), strict=True):
            s.returns = r.float()
    truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.bool)
    weights, wstats = compute_loss_weights(batch, truncated, cfg)
    if weights is not None:
        for s, w in zip(samples, unpack(weights, batch.cu_seqlens), strict=True):
            s.loss_weights = w.float()
    return {**stats, **wstats}
