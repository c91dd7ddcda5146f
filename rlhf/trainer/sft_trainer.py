"""Packed SFT: negative log-likelihood of the assistant turns (epoch loop in ``supervised``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.data.types import Sample
from rlhf.trainer.objectives import SFTObjective
from rlhf.trainer.supervised import SupervisedTrainer

__all__ = ["SFTTrainer", "sft_nll"]


class SFTTrainer(SupervisedTrainer):
    """Negative log-likelihood of the assistant tokens (``Sample.action_mask``), packed."""

    def __init__(self, cfg, group, train_samples: Sequence[Sample], eval_samples: Sequence[Sample] = ()):
        super().__init__(cfg, group, [(s,) for s in train_samples], [(s,) for s in eval_samples])
        self.objective = SFTObjective(aggregation=cfg.sft.aggregation)

    def evaluate(self) -> dict[str, float]:
        """Token-mean NLL of the held-out assistant tokens (whatever ``sft.aggregation`` trains with)."""
        samples = [u[0] for u in self.eval_units]
        return {
            "loss": sft_nll(self.group.forward(samples, self.cfg.train.max_tokens_per_microbatch), samples)
        }


def sft_nll(logprobs: Sequence[torch.Tensor], samples: Sequence[Sample]) -> float:
    """Token-mean NLL over the action tokens of ``samples`` given their per-token logprobs."""
    nll = sum(float(-lp[s.action_mask].sum()) for s, lp in zip(samples, logprobs, strict=True))
    return nll / max(1, sum(s.num_actions for s in samples))
