"""Pairwise (Bradley-Terry) reward model, trained packed; saved as a sequence-classification dir.

The trainable group is a ``critic``-role ``ModelGroup`` on the causal-LM directory: that
role builds ``AutoModelForSequenceClassification`` (``num_labels=1``) with a fresh ``score``
head (``rlhf.models.forward.build_value_model``) and is trainable, while the ``reward`` role
is inference-only. The saved ``<output_dir>/final`` is therefore a ``*ForSequenceClassification``
model (+ tokenizer) that the PPO ``reward`` role loads (``reward.type=model``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.algorithms.losses import pairwise_rm_loss
from rlhf.data.types import Sample
from rlhf.trainer.pref_objectives import RMObjective
from rlhf.trainer.sft_trainer import SupervisedTrainer

__all__ = ["RMTrainer", "last_token_scores"]

Pair = tuple[Sample, Sample]


def last_token_scores(critic, samples: Sequence[Sample], max_tokens_per_microbatch: int) -> torch.Tensor:
    """Reward-model scores ``[B]`` (head on each sample's last token) from a critic-role group.

    A critic group's forward returns ``values[t] = score(hidden[t - 1])``: the last token's own
    hidden state never shows. With one extra token appended, its value *is* the score at the
    original last token, and causal attention keeps everything before it unchanged.
    """
    padded = [
        Sample(
            input_ids=torch.cat([s.input_ids, s.input_ids[-1:]]),
            action_mask=torch.cat([s.action_mask, torch.zeros(1, dtype=torch.bool)]),
        )
        for s in samples
    ]
    values = critic.forward(padded, max_tokens_per_microbatch + 1)
    return torch.stack([v[-1] for v in values])


class RMTrainer(SupervisedTrainer):
    """``-logsigmoid(r_chosen - r_rejected)`` on pairs kept in one micro-batch."""

    def __init__(self, cfg, group, train_pairs: Sequence[Pair], eval_pairs: Sequence[Pair] = ()):
        super().__init__(cfg, group, [tuple(p) for p in train_pairs], [tuple(p) for p in eval_pairs])
        self.objective = RMObjective()

    def evaluate(self, pairs: Sequence[Pair] | None = None) -> dict[str, float]:
        """Pairwise loss, score margin and accuracy on ``pairs`` (default: the held-out pairs)."""
        pairs = self.eval_units if pairs is None else list(pairs)
        scores = last_token_scores(
            self.group, [s for p in pairs for s in p], self.cfg.train.max_tokens_per_microbatch
        )
        chosen, rejected = scores[0::2], scores[1::2]
        return {
            "loss": float(pairwise_rm_loss(chosen, rejected)),
            "scores/margin": float((chosen - rejected).mean()),
            "scores/accuracy": float((chosen > rejected).float().mean()),
        }
