"""Pairwise (Bradley-Terry) reward model, trained packed; saved as a sequence-classification dir.

The trainable group is a ``reward``-role ``ModelGroup`` with ``lr > 0`` on the causal-LM
directory: that role builds ``AutoModelForSequenceClassification`` (``num_labels=1``) with a
fresh ``score`` head (``rlhf.models.forward.build_value_model``), and its forward gives each
sample's score at its last token, the quantity the objective trains. The saved
``<output_dir>/final`` is therefore a ``*ForSequenceClassification`` model (+ tokenizer) that
the PPO ``reward`` role (``reward.type=model``, lr 0, inference-only) loads with its head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.algorithms.losses import pairwise_rm_loss
from rlhf.data.types import Sample
from rlhf.trainer.pref_objectives import RMObjective
from rlhf.trainer.supervised import SupervisedTrainer

__all__ = ["RMTrainer"]

Pair = tuple[Sample, Sample]


class RMTrainer(SupervisedTrainer):
    """``-logsigmoid(r_chosen - r_rejected)`` on pairs kept in one micro-batch (a ``reward`` group, lr > 0)."""

    def __init__(self, cfg, group, train_pairs: Sequence[Pair], eval_pairs: Sequence[Pair] = ()):
        super().__init__(cfg, group, [tuple(p) for p in train_pairs], [tuple(p) for p in eval_pairs])
        self.objective = RMObjective()

    def evaluate(self, pairs: Sequence[Pair] | None = None) -> dict[str, float]:
        """Pairwise loss, score margin and accuracy on ``pairs`` (default: the held-out pairs)."""
        pairs = self.eval_units if pairs is None else list(pairs)
        samples = [s for p in pairs for s in p]
        scores = torch.stack(self.group.forward(samples, self.cfg.train.max_tokens_per_microbatch))
        chosen, rejected = scores[0::2], scores[1::2]
        return {
            "loss": float(pairwise_rm_loss(chosen, rejected)),
            "scores/margin": float((chosen - rejected).mean()),
            "scores/accuracy": float((chosen > rejected).float().mean()),
        }
