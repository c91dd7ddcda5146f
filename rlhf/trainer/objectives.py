"""Training objectives: what one packed micro-batch contributes to the loss.

An objective is a small picklable object (it travels to every Ray rank with each train
call) with three methods:

- ``__call__(model, mb, loss_scale) -> (loss, stats)``: forward the raw HF model on the
  packed micro-batch ``mb`` (``rlhf.models.forward``), reduce with ``rlhf.algorithms``, and
  return the loss *multiplied by* ``loss_scale`` (what is back-propagated) and detached
  0-dim stats of the *unscaled* micro-batch loss (``stats["loss"]`` is required).
- ``loss_weight(mb) -> float``: how much ``mb`` weighs in the mini-batch mean: its number of
  loss tokens for ``token_mean``, its number of samples with a loss token for the
  ``seq_mean_*`` aggregations. The model group sums it over every micro-batch of a
  mini-batch on every rank (the normaliser ``N``) and each rank calls the objective with
  ``loss_scale = loss_weight(mb) / N * world_size``; since DeepSpeed averages gradients over
  ranks, the optimizer then sees exactly the gradient of the mini-batch mean.
- ``dummy_batch() -> FlatBatch``: a tiny batch a rank runs at zero weight when it has fewer
  micro-batches than the others, so that every rank runs the same collectives.

Extension point: pairwise objectives (DPO, reward model) subclass ``Objective``, override
``loss_weight`` (number of pairs) and ``dummy_batch`` (one pair), and are trained with
``ModelGroup.train(..., units=pairs)`` so the two halves of a pair share a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algorithms.kl import kl_estimator
from rlhf.algorithms.losses import aggregate_loss, sft_loss, value_loss
from rlhf.algorithms.masking import masked_mean, segment_sum
from rlhf.algorithms.registry import POLICY_LOSSES
from rlhf.data.packing import dummy_flat_batch
from rlhf.data.types import FlatBatch
from rlhf.models.objective import Stats

__all__ = ["Objective", "PolicyObjective", "SFTObjective", "ValueObjective"]


def _require(mb: FlatBatch, objective: str, *names: str) -> None:
    missing = [n for n in names if getattr(mb, n) is None]
    if missing:
        raise ValueError(
            f"{objective} needs the per-token fields {missing} on every sample (fill them in the "
            "scoring/advantage step before training)"
        )


@dataclass
class Objective:
    """Base class: token/sequence weighting and the dummy batch (see module docstring)."""

    aggregation: str = "token_mean"

    def loss_mask(self, mb: FlatBatch) -> torch.Tensor:
        """``[T]`` bool: the tokens that carry this objective's loss."""
        return mb.action_mask.bool()

    def loss_weight(self, mb: FlatBatch) -> float:
        mask = self.loss_mask(mb)
        if self.aggregation == "token_mean":
            return float(mask.sum())
        # seq_mean_*: samples without any loss token are excluded from the mean over samples.
        return float((segment_sum(mask.long(), mb.cu_seqlens) > 0).sum())

    def dummy_batch(self) -> FlatBatch:
        return dummy_flat_batch()

    def __call__(
        self, model: torch.nn.Module, mb: FlatBatch, loss_scale: float
    ) -> tuple[torch.Tensor, Stats]:
        raise NotImplementedError


@dataclass
class PolicyObjective(Objective):
    """Clipped policy loss on the action tokens, optional KL-to-reference loss and entropy bonus.

    ``loss = policy_loss + kl_coef_in_loss * KL(pi || ref) - entropy_coef * H``, each term
    reduced with ``aggregation``; ``policy_loss`` names a row of
    ``rlhf.algorithms.registry.POLICY_LOSSES`` (``ppo``, ``gspo``). ``temperature`` must be the
    rollout sampling temperature, so that the logprobs match ``mb.old_logprobs``. ``dual_clip``
    of 0 or None disables dual clip; ``kl_clamp`` of 0 or None leaves the KL unclamped.

    ``mb.loss_weights`` (rollout correction, overlong filter), when set, multiply the policy
    term per token, and a token of weight 0 carries no loss at all: it leaves every term and
    the normaliser (``loss_mask``).
    """

    policy_loss: str = "ppo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    kl_coef_in_loss: float = 0.0
    kl_kind: str = "k3"
    kl_clamp: float | None = None
    entropy_coef: float = 0.0
    temperature: float = 1.0

    def loss_mask(self, mb: FlatBatch) -> torch.Tensor:
        mask = mb.action_mask.bool()
        return mask if mb.loss_weights is None else mask & (mb.loss_weights > 0)

    def __call__(
        self, model: torch.nn.Module, mb: FlatBatch, loss_scale: float
    ) -> tuple[torch.Tensor, Stats]:
        from rlhf.models.forward import packed_logprobs

        _require(mb, "PolicyObjective", "advantages")
        if self.kl_coef_in_loss:
            _require(mb, "PolicyObjective with kl_coef_in_loss", "ref_logprobs")
        # entropy_coef == 0: the entropy is only a statistic; keep no [T, V] graph for it.
        logprobs, entropy = packed_logprobs(
            model, mb, temperature=self.temperature, return_entropy=True, entropy_grad=self.entropy_coef != 0
        )
        mask, cu = self.loss_mask(mb), mb.cu_seqlens
        # No old logprobs: this is the only optimizer step on samples of these very weights,
        # so the policy before the update is this forward's own (PPOConfig.old_logprobs_are_current).
        old = logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs
        policy_loss, stats = POLICY_LOSSES[self.policy_loss].fn(
            logprobs,
            old,
            mb.advantages,
            mask,
            cu,
            clip_eps_low=self.clip_eps_low,
            clip_eps_high=self.clip_eps_high,
            dual_clip=self.dual_clip or None,
            aggregation=self.aggregation,
            weights=mb.loss_weights,
        )
        loss = policy_loss
        if self.kl_coef_in_loss:
            kl = kl_estimator(
                logprobs, mb.ref_logprobs, kind=self.kl_kind, clamp=self.kl_clamp or None, action_mask=mask
            )
            kl_loss = aggregate_loss(kl, mask, cu, self.aggregation)
            loss = loss + self.kl_coef_in_loss * kl_loss
            stats["kl_loss"] = kl_loss.detach()
        ent = aggregate_loss(entropy, mask, cu, self.aggregation)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * ent
        stats.update(entropy=ent.detach(), policy_loss=policy_loss.detach(), loss=loss.detach())
        if mb.old_logprobs is None:
            stats.update(self._before_update_stats(logprobs.detach(), mb))
        return loss * loss_scale, stats

    def _before_update_stats(self, logprobs: torch.Tensor, mb: FlatBatch) -> Stats:
        """What the scorer's actor forward would have measured, from this forward (same weights):
        the KL to the reference and the engine/trainer logprob gap, token means."""
        mask = mb.action_mask.bool()
        out: Stats = {}
        if mb.ref_logprobs is not None:
            kl = kl_estimator(logprobs, mb.ref_logprobs, kind=self.kl_kind, clamp=self.kl_clamp or None)
            out["kl_before_update"] = masked_mean(kl, mask)
        if mb.rollout_logprobs is not None:
            out["logprob_gap"] = masked_mean((logprobs - mb.rollout_logprobs).abs(), mask)
        return out


@dataclass
class ValueObjective(Objective):
    """Clipped value loss of the critic against ``mb.returns`` around ``mb.values`` (old values)."""

    clip_eps: float | None = 0.2

    def __call__(
        self, model: torch.nn.Module, mb: FlatBatch, loss_scale: float
    ) -> tuple[torch.Tensor, Stats]:
        from rlhf.models.forward import packed_hidden_values

        _require(mb, "ValueObjective", "values", "returns")
        values = packed_hidden_values(model, mb)
        loss, stats = value_loss(
            values,
            mb.values,
            mb.returns,
            mb.action_mask,
            mb.cu_seqlens,
            clip_eps=self.clip_eps or None,
            aggregation=self.aggregation,
        )
        stats["loss"] = loss.detach()
        return loss * loss_scale, stats


@dataclass
class SFTObjective(Objective):
    """Negative log-likelihood of the ``action_mask`` tokens (the assistant turns)."""

    def __call__(
        self, model: torch.nn.Module, mb: FlatBatch, loss_scale: float
    ) -> tuple[torch.Tensor, Stats]:
        from rlhf.models.forward import packed_logprobs

        logprobs, _ = packed_logprobs(model, mb)
        loss = sft_loss(logprobs, mb.action_mask, mb.cu_seqlens, aggregation=self.aggregation)
        return loss * loss_scale, {"loss": loss.detach()}


# Pairwise objectives (DPO, reward model) live in rlhf.trainer.pref_objectives.
