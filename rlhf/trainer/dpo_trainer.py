"""Packed DPO: reference logprobs once up front, then pairs through the policy group.

The reference model is frozen, so its per-token logprobs of every sample (train and
held-out) are computed once (``fill_reference``) and travel with the samples as
``Sample.ref_logprobs``; the reference group can then be released before the policy starts,
and no step pays for a second forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.algorithms.losses import dpo_loss
from rlhf.data.types import Sample
from rlhf.trainer.pref_objectives import DPOObjective
from rlhf.trainer.supervised import SupervisedTrainer

__all__ = ["DPOTrainer", "fill_reference", "pair_logprob_sums"]

Pair = tuple[Sample, Sample]


def fill_reference(reference, pairs: Sequence[Pair], max_tokens_per_microbatch: int) -> None:
    """Set ``ref_logprobs`` of every sample of ``pairs`` from the ``reference`` group (in place)."""
    samples = [s for p in pairs for s in p]
    for s, lp in zip(samples, reference.forward(samples, max_tokens_per_microbatch), strict=True):
        s.ref_logprobs = lp


def pair_logprob_sums(
    logprobs: Sequence[torch.Tensor], pairs: Sequence[Pair]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-token logprob sums ``[P]`` of the chosen and the rejected samples.

    ``logprobs`` holds per-token logprobs of ``[chosen_0, rejected_0, chosen_1, ...]``.
    """
    sums = torch.stack(
        [lp[s.action_mask].sum() for (s, lp) in zip((x for p in pairs for x in p), logprobs, strict=True)]
    )
    return sums[0::2], sums[1::2]


class DPOTrainer(SupervisedTrainer):
    """Sigmoid DPO (``dpo.beta``, ``dpo.label_smoothing``) on (chosen, rejected) pairs kept in one micro-batch.

    Every sample must already carry ``ref_logprobs`` (see ``fill_reference``).
    """

    def __init__(self, cfg, group, train_pairs: Sequence[Pair], eval_pairs: Sequence[Pair] = ()):
        for p in (*train_pairs, *eval_pairs):
            if p[0].ref_logprobs is None or p[1].ref_logprobs is None:
                raise ValueError("DPOTrainer needs ref_logprobs on every sample: call fill_reference first")
        super().__init__(cfg, group, [tuple(p) for p in train_pairs], [tuple(p) for p in eval_pairs])
        self.objective = DPOObjective(beta=cfg.dpo.beta, label_smoothing=cfg.dpo.label_smoothing)

    def evaluate(self, pairs: Sequence[Pair] | None = None) -> dict[str, float]:
        """DPO loss, implicit-reward margin and preference accuracy of the policy on ``pairs`` (default: held out)."""
        pairs = self.eval_units if pairs is None else list(pairs)
        samples = [s for p in pairs for s in p]
        policy_c, policy_r = pair_logprob_sums(
            self.group.forward(samples, self.cfg.train.max_tokens_per_microbatch), pairs
        )
        ref_c, ref_r = pair_logprob_sums([s.ref_logprobs for s in samples], pairs)
        loss, rc, rr = dpo_loss(
            policy_c, policy_r, ref_c, ref_r, self.cfg.dpo.beta, self.cfg.dpo.label_smoothing
        )
        margin = rc - rr
        return {
            "loss": float(loss),
            "rewards/margin": float(margin.mean()),
            "rewards/accuracy": float((margin > 0).float().mean()),
            "logps/chosen": float(policy_c.mean()),
            "logps/rejected": float(policy_r.mean()),
        }
