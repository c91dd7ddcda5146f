"""The advantage step of the PPO loop: KL, token rewards and advantages for a batch.

Thin glue that picks the estimator named by ``algorithm.advantage`` and calls the pure
functions in ``rlhf.algorithms`` on the flat (unpadded) batch.
"""

from __future__ import annotations

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
from rlhf.algorithms.kl import kl_estimator
from rlhf.algorithms.masking import masked_mean, masked_whiten, segment_sum
from rlhf.data.packing import concat, unpack
from rlhf.data.types import FlatBatch, Sample


def per_token_kl(batch: FlatBatch, kind: str) -> torch.Tensor | None:
    """KL(actor || reference) estimate on action tokens, 0 elsewhere; None without a reference."""
    if batch.ref_logprobs is None or batch.old_logprobs is None:
        return None
    kl = kl_estimator(batch.old_logprobs, batch.ref_logprobs, kind=kind)
    return torch.where(batch.action_mask, kl, torch.zeros_like(kl))


def compute_advantages(batch: FlatBatch, cfg) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Advantages [T] (and returns [T] for GAE) for ``algorithm.advantage``.

    ``cfg`` is an ``AlgorithmConfig``. With ``kl_in_reward`` the KL penalty is folded into the
    token rewards; otherwise it is left to the policy loss (GRPO style).
    """
    mask, cu = batch.action_mask, batch.cu_seqlens
    kl = per_token_kl(batch, cfg.kl_kind)
    kl_r = kl if cfg.kl_in_reward else None
    scores = batch.scores.float()
    returns = None
    adv_kind = cfg.advantage
    if adv_kind == "gae":
        if batch.values is None:
            raise ValueError("algorithm.advantage=gae needs critic values; the critic group is missing")
        rewards = token_level_rewards(scores, kl_r, cfg.kl_coef, mask, cu)
        adv, returns = gae(batch.values, rewards, mask, cu, gamma=cfg.gamma, lam=cfg.lam)
    elif adv_kind == "reinforce_pp":
        adv = reinforce_pp_returns(
            token_level_rewards(scores, kl_r, cfg.kl_coef, mask, cu), mask, cu, cfg.gamma
        )
    elif adv_kind == "reinforce_pp_baseline":
        base = reinforce_pp_baseline(scores, batch.group_ids)
        adv = reinforce_pp_returns(
            token_level_rewards(base, kl_r, cfg.kl_coef, mask, cu), mask, cu, cfg.gamma
        )
    else:
        seq = scores
        if kl_r is not None:
            # Sequence estimators see the KL penalty as a sequence-level cost.
            seq = seq - cfg.kl_coef * segment_sum(kl_r, cu)
        if adv_kind in ("grpo", "dr_grpo"):
            seq_adv = grpo_advantages(seq, batch.group_ids, scale_by_std=adv_kind == "grpo")
        elif adv_kind == "rloo":
            seq_adv = rloo_advantages(seq, batch.group_ids)
        else:
            raise ValueError(f"algorithm.advantage={adv_kind!r} is not implemented")
        adv = broadcast_sequence_advantages(seq_adv, mask, cu)
    if cfg.normalize_advantages and bool(mask.any()):
        adv = masked_whiten(adv, mask)  # exactly 0 off the mask
    stats = {"advantages/mean": float(masked_mean(adv, mask)) if mask.any() else 0.0}
    if kl is not None and mask.any():
        stats["kl"] = float(masked_mean(kl, mask))
    return adv, returns, stats


def advantage_step(samples: list[Sample], cfg) -> dict[str, float]:
    """Compute advantages (and returns) for ``samples`` in place; returns stats."""
    batch = concat(samples)
    adv, returns, stats = compute_advantages(batch, cfg)
    for s, a in zip(samples, unpack(adv, batch.cu_seqlens), strict=True):
        s.advantages = a.float()
    if returns is not None:
        for s, r in zip(samples, unpack(returns, batch.cu_seqlens), strict=True):
            s.returns = r.float()
    return stats
