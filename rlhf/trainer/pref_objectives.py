"""Pairwise objectives: DPO on a causal LM, Bradley-Terry on a reward (sequence-score) model.

Both are trained with ``ModelGroup.train(samples, objective, ..., units=pairs)`` where
``samples`` is ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]`` and ``pairs`` is
``[[0, 1], [2, 3], ...]``: ``rlhf.data.packing.pack`` keeps each unit in one micro-batch,
contiguous and in unit order, so inside a packed micro-batch the samples alternate
chosen, rejected, and ``sample_index`` of a chosen sample is even with its rejected
sample right after it. Both objectives check that layout instead of trusting it.

Loss weighting: ``loss_weight(mb)`` is the number of pairs, so the mini-batch loss is the
mean over pairs whatever the packing; ``dummy_batch`` is one zero-length-response pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algorithms.losses import dpo_loss, pairwise_rm_loss
from rlhf.algorithms.masking import segment_sum
from rlhf.data.packing import dummy_flat_batch
from rlhf.data.types import FlatBatch
from rlhf.models.objective import Stats
from rlhf.trainer.objectives import Objective

__all__ = ["DPOObjective", "PairObjective", "RMObjective", "pair_layout", "sequence_logprob_sums"]


def pair_layout(mb: FlatBatch) -> tuple[slice, slice]:
    """Slices of the chosen and rejected samples of a packed micro-batch of pairs.

    Raises:
        ValueError: the micro-batch holds an odd number of samples, or a sample whose
            partner is not next to it (a pair was split, or the units were not ``[2k, 2k+1]``).
    """
    n = mb.num_samples
    if n % 2:
        raise ValueError(
            f"a micro-batch of pairs must hold an even number of samples, got {n}: train "
            "with ModelGroup.train(..., units=[[0, 1], [2, 3], ...])"
        )
    idx = mb.sample_index
    chosen, rejected = idx[0::2], idx[1::2]
    # The dummy batch (sample_index -1) carries no pairing; every real one must.
    if bool((idx >= 0).any()) and not (
        bool((chosen % 2 == 0).all()) and bool((rejected == chosen + 1).all())
    ):
        raise ValueError(
            f"micro-batch samples {idx.tolist()} are not (chosen 2k, rejected 2k+1) pairs kept "
            "together: pass units=[[0, 1], [2, 3], ...] to ModelGroup.train"
        )
    return slice(0, None, 2), slice(1, None, 2)


def sequence_logprob_sums(logprobs: torch.Tensor, mb: FlatBatch) -> torch.Tensor:
    """Per-sample sum of per-token logprobs over the action (response) tokens: ``[B]``."""
    return segment_sum(logprobs, mb.cu_seqlens, mb.action_mask)


@dataclass
class PairObjective(Objective):
    """Weighting shared by the pairwise objectives: one unit of weight per (chosen, rejected) pair."""

    def loss_weight(self, mb: FlatBatch) -> float:
        return float(mb.num_samples // 2)

    def dummy_batch(self) -> FlatBatch:
        return dummy_flat_batch(num_samples=2)


@dataclass
class DPOObjective(PairObjective):
    """Sigmoid DPO (with cDPO label smoothing) on packed pairs.

    ``mb.ref_logprobs`` holds the reference model's per-token logprobs (computed once before
    training, ``ModelGroup.forward`` of the reference); they are summed over the same action
    tokens as the policy's, so both sides score exactly the same response tokens.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0

    def __call__(
        self, model: torch.nn.Module, mb: FlatBatch, loss_scale: float
    ) -> tuple[torch.Tensor, Stats]:
        from rlhf.models.forward import packed_logprobs

        if mb.ref_logprobs is None:
            raise ValueError(
                "DPOObjective needs ref_logprobs on every sample (the reference model's "
                "per-token logprobs, filled before training)"
            )
        c, r = pair_layout(mb)
        logprobs, _ = packed_logprobs(model, mb)
        policy = sequence_logprob_sums(logprobs, mb)
        ref = sequence_logprob_sums(mb.ref_logprobs.to(policy.dtype), mb)
        loss, chosen_rewards, rejected_rewards = dpo_loss(
            policy[c], policy[r], ref[c], ref[r], beta=self.beta, label_smoothing=self.label_smoothing
        )
        margin = chosen_rewards - rejected_rewards
        stats = {
            "loss": loss.detach(),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margin": margin.mean(),
            "rewards/accuracy": (margin > 0).float().mean(),
            "logps/chosen": policy[c].detach().mean(),
            "logps/rejected": policy[r].detach().mean(),
        }
        return loss * loss_scale, stats


@dataclass
class RMObjective(PairObjective):
    """Bradley-Terry loss on the reward model's score at each sample's last token."""

    def __call__(
        self, model: torch.nn.Module, mb: FlatBatch, loss_scale: float
    ) -> tuple[torch.Tensor, Stats]:
        from rlhf.models.forward import packed_sequence_scores

        c, r = pair_layout(mb)
        scores = packed_sequence_scores(model, mb).float()
        chosen, rejected = scores[c], scores[r]
        loss = pairwise_rm_loss(chosen, rejected)
        margin = (chosen - rejected).detach()
        stats = {
            "loss": loss.detach(),
            "scores/chosen": chosen.detach().mean(),
            "scores/rejected": rejected.detach().mean(),
            "scores/margin": margin.mean(),
            "scores/accuracy": (margin > 0).float().mean(),
        }
        return loss * loss_scale, stats
