"""What a model worker needs of a training objective: a protocol, so workers never import
the trainer that defines the concrete objectives (``rlhf.trainer.objectives``)."""

from __future__ import annotations

from typing import Protocol

import torch

from rlhf.data.types import FlatBatch

__all__ = ["Stats", "TrainObjective"]

Stats = dict[str, torch.Tensor]


class TrainObjective(Protocol):
    """A picklable loss over one packed micro-batch (see ``rlhf.trainer.objectives`` for the rules).

    - ``__call__(model, mb, loss_scale)``: ``(loss * loss_scale, detached stats of the unscaled loss)``;
      ``stats["loss"]`` is required.
    - ``loss_weight(mb)``: how much ``mb`` weighs in the mini-batch mean.
    - ``dummy_batch()``: what a rank short of micro-batches runs at zero weight.
    """

    def __call__(
        self, model: torch.nn.Module, mb: FlatBatch, loss_scale: float
    ) -> tuple[torch.Tensor, Stats]: ...

    def loss_weight(self, mb: FlatBatch) -> float: ...

    def dummy_batch(self) -> FlatBatch: ...
